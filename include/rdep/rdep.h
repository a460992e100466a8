// rdep: the umbrella header. A C++ training stack includes this and links rdep::rdep.
//   core       shapes, ownership, route-row identity, routing generators, capacity, reference operator
//   transport  the Domain of W ranks (host backend: threads; peer-visible regions; bounded barriers)
//   layer      the MoE layer (forward/backward over the RDEP protocol) and the validation matrix
#pragma once

#include "rdep/core/capacity.h"
#include "rdep/core/ownership.h"
#include "rdep/core/reference.h"
#include "rdep/core/routing.h"
#include "rdep/core/row_id.h"
#include "rdep/core/shape.h"
#include "rdep/core/stats.h"
#include "rdep/layer/forward_context.h"
#include "rdep/layer/host_moe_layer.h"
#include "rdep/layer/layer_config.h"
#include "rdep/status.h"
#include "rdep/testing/validation.h"
#include "rdep/transport/domain.h"
#include "rdep/transport/host_domain.h"
