/* rdep's C ABI: MoE layers and the domains they run on behind opaque handles, for the Python package
 * (ctypes, no libtorch at build time) and any other foreign-function caller.
 *
 * A domain (rdep_domain) is the ranks and their transport: host threads, or CUDA (ranks sharing GPUs in
 * one process, or this process as one rank of a world under a launcher). A layer (rdep_layer) is one MoE
 * layer over a domain. rdep_layer_create makes a layer with a domain of its own; rdep_domain_create and
 * rdep_layer_create_on (version 4) put several layers on one domain, so that their balanced layers
 * share one set of replica slots (the redundant expert slots' weights and gradients: a model of many
 * balanced layers holds them once, not once per layer; rdep_domain_memory). A process drives the ranks
 * [first, first + count) of the W ranks (rdep_layer_local_ranks): all W on the host backend and in the
 * CUDA one-process mode, one in the per-process mode. Every call takes one rdep_rank_io per local rank,
 * in rank order, and runs the collective for all of them (one thread per rank inside; a single local rank
 * runs on the calling thread).
 *
 * Element types: host backend fp32 everywhere; CUDA backend bf16 activations (x, y, dy, dx) and expert
 * weights (w1, w2), fp32 gates and dgates, weight gradients (dw1, dw2) fp32 or, with grad_bf16, bf16;
 * on CUDA w1, w2, dw1, dw2 must be 16-byte aligned. Experts are int32. Pointers are
 * host memory (host backend) or device memory on the rank's GPU (rdep_layer_device).
 * Expert weights are the caller's, passed to every call: w1 [E_r][H][2F] (columns [0, F) the gate
 * projection, [F, 2F) the up projection), w2 [E_r][F][H], for the E_r experts rank r owns, in expert
 * order (rdep_layer_owned_experts; ownership is contiguous). A backward must be given the weights of its
 * forward. Weight gradients are written (not accumulated) into dw1, dw2. Version 13: a backward's w1 may lie
 * inside the same rank's dw1 bytes and its w2 inside its dw2 bytes (a caller with fp32 master weights casts
 * the rank's w1 to bf16 as one contiguous [E_r][H][2F] array in the first half of its fp32 dw1 bytes, and w2
 * likewise in dw2, and holds no separate copy during the backward) on the
 * CUDA backend with expert_compute CUTLASS, one segment per forward, no balancing and one node, where the
 * backward reads each weight before it writes that weight's gradient; any other overlap of weights and
 * gradients (another rank's, w1 with dw2, or another configuration) is refused before the collective.
 *
 * Contexts: rdep_context_acquire hands out a slot holding one forward's saved state per local rank
 * (caller-owned in the C++ API's sense); slots are pooled, so their memory is reused, and a released
 * slot's id is stale (releasing it again is a no-op; using it is an error).
 *
 * Streams (CUDA): io.stream is the caller's stream on the rank's device (0 for the legacy default
 * stream); the layer's work on the rank's own stream is ordered after the caller's stream's prior work
 * and before its later work (event joins). With the cuBLASLt expert compute (the default) the layer
 * waits on the host once per forward segment (its expert GEMMs take per-expert row counts on the host),
 * and since its stream first waits for the caller's, that wait also covers the caller's earlier work;
 * with expert_compute CUTLASS and no balancing it waits nowhere (any segment size; with nodes > 1 one
 * segment), so its calls can be captured in a CUDA graph.
 *
 * Threads: calls on one domain are serialized (a second caller waits, whichever of the domain's layers
 * it calls; creating and destroying a layer wait too); layers on different domains are independent.
 * Layers on one domain may be used in any order (layer A forward, B forward, B backward, A backward):
 * each call writes the shared slots before it reads them.
 * Errors: arguments are checked before any rank starts the collective. In the per-process mode an
 * argument error on one process therefore leaves the other processes to time out at their first
 * barrier (a Timeout naming the missing rank and phase), after which the layer must be recreated:
 * check arguments identically on every process before calling.
 *
 * Every function returns 0 or an rdep status code (rdep/status.h: 1 InvalidArgument, ...); the calling
 * thread's last error message is rdep_last_error(). */
#ifndef RDEP_CAPI_H_
#define RDEP_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RDEP_CAPI_VERSION 23

typedef struct rdep_layer rdep_layer;
typedef struct rdep_domain rdep_domain;

/* Caller-supplied allgather for the per-process mode: every rank calls it with `bytes` bytes; recv
 * gets world_size * bytes, rank-major. Returns 0 on success. */
typedef int (*rdep_allgather_fn)(void* user, const void* send, size_t bytes, void* recv);

enum rdep_backend_kind {
  RDEP_BACKEND_HOST = 0,          /* W threads of this process, fp32 */
  RDEP_BACKEND_CUDA_ONE_PROCESS = 1, /* W ranks of this process over num_gpus local GPUs */
  RDEP_BACKEND_CUDA_PER_PROCESS = 2  /* this process is rank `process_rank` of W, on GPU `device` */
};

/* Version 4. A domain: the fields of rdep_layer_spec that place the ranks, with their meanings there. */
typedef struct rdep_domain_spec {
  int32_t struct_size;  /* sizeof(rdep_domain_spec) */
  int32_t backend;      /* rdep_backend_kind */
  int32_t world_size;   /* W */
  int32_t num_gpus;     /* one-process CUDA: ranks round-robin over this many GPUs (0 = min(W, present)) */
  int32_t process_rank; /* per-process CUDA: this process's rank */
  int32_t device;       /* per-process CUDA: this process's GPU (-1: local rank mod the GPUs present) */
  double barrier_timeout_s; /* 0 = the default (30 s) */
  rdep_allgather_fn allgather; /* per-process CUDA; called while the domain and each layer on it are created */
  void* allgather_user;
} rdep_domain_spec;

typedef struct rdep_layer_spec {
  int32_t struct_size; /* sizeof(rdep_layer_spec) */
  int32_t backend;     /* rdep_backend_kind */
  int32_t world_size;  /* W */
  int32_t num_gpus;    /* one-process CUDA: ranks round-robin over this many GPUs (0 = min(W, present)) */
  int32_t process_rank; /* per-process CUDA: this process's rank */
  int32_t device;       /* per-process CUDA: this process's GPU (-1: local rank mod the GPUs present) */
  int64_t tokens;       /* T: most tokens a rank passes to one call */
  int64_t hidden;       /* H */
  int64_t ffn;          /* D_ff (F) */
  int64_t experts;      /* E */
  int64_t topk;         /* K */
  double capacity_factor; /* 0 = dropless; else ceil(C*W*T*K/E) rows per expert */
  int64_t segment_tokens; /* 0 = the backend's default */
  double barrier_timeout_s; /* 0 = the default (30 s) */
  rdep_allgather_fn allgather; /* per-process CUDA */
  void* allgather_user;
  /* Version 2. Balancing (host backend so far): replicas of hot experts in redundant slots. */
  int32_t balance;             /* rdep_balance_kind (0 = off) */
  int32_t balance_slots;       /* N_slot: redundant slots per rank */
  int64_t balance_min_quota;   /* u_min (ultraep; 0 = 1) */
  int32_t balance_relay_above; /* experts with more replicas stream through chunk relays; -1 = default (4), 0 = never */
  /* Nodes: N nodes of world_size/N ranks, the two-phase exchange, node cap M (CUDA: not with
     expert_compute cutlass). */
  int32_t nodes;               /* N (0 or 1 = one domain) */
  int32_t max_nodes;           /* M: routing must keep each token on at most M nodes (0 = N) */
  /* Version 3. CUDA: the expert compute, 0 = cuBLASLt (the counts read on the host once per forward
   * segment), 1 = CUTLASS grouped GEMMs for sm_90a (the counts read on the device: with no
   * balancing, no host wait in the layer; with nodes > 1 only in one segment). The host backend ignores it. */
  int32_t expert_compute;
  /* Version 5. 1 = the owner sums a token's rows before they cross back (one row per (token, owner)
   * instead of one per slot; dgate's dot products taken by the owner): LayerConfig::owner_reduce. Not
   * with nodes > 1. */
  int32_t owner_reduce;
  /* Version 6. CUDA: the SM budget of the one-domain exchange's kernels that store into peer memory
   * (scatter, return, the owner's reduce and dot products): that many blocks, so at most that many SMs,
   * in [0, 1024]; 0 = grids sized by the work (every SM). Not with nodes > 1. LayerConfig::transport_sms.
   * The host backend ignores it. */
  int32_t transport_sms;
  int32_t reserved; /* must be 0 (version 6 made the struct 152 bytes, so a version-5 caller's struct_size differs) */
  /* Version 9. UltraEP's gain gate: no replicas unless they lower the busiest rank's rows by at least this
   * many rows each (a replica's weight streaming and gradient reduction cost the same whatever it carries);
   * 0 = off. Only with balance = ultraep. BalanceConfig::min_gain. */
  int64_t balance_min_gain;
  /* Version 10. CUDA: the paged stash, LayerConfig::stash_rows: > 0 keeps a sync-free forward's saved owner
   * rows in pages of a pool of this many rows per rank, shared by the domain's layers of one shape and pool
   * size, so that a context holds only the rows that arrived (the worst case is then one transient buffer
   * shared by those layers); when a forward overflows the pool on any rank, every rank's backward of that
   * forward fails before its exchange, naming the ranks, their rows and the pool (dx, dgates and weight
   * gradients NaN). 0 = off.
   * Needs expert_compute 1 (CUTLASS), no balancing, one node; not inside a CUDA graph capture. The host
   * backend ignores it. */
  int64_t stash_rows;
  /* Version 11. CUDA: 1 = the overlapped segment pipeline, LayerConfig::overlap_segments: the dispatch of
   * segment s+1 and the return of s-1 run beside the experts' compute of s (a second stream per rank), the
   * same bits as in sequence; it fills only with more than one segment (segment_tokens < world_size * tokens).
   * With transport_sms > 0 (at most half the GPU's SMs) the expert GEMMs leave that many SMs. Needs
   * expert_compute 1, no balancing, one node and owner_reduce 0. The host backend ignores it. */
  int64_t overlap_segments;
  /* Version 12. CUDA: 1 = the gate multiplied before W2, LayerConfig::gate_in_expert: the owners' expert compute
   * weights each row before W2, so the front-end keeps no expert outputs for backward (T*K*H values a context
   * less) and the owners take dgate's dot products; y and the gradients differ by bf16 rounding. Needs
   * expert_compute 1, no balancing, one node and owner_reduce 0. The host backend ignores it. */
  int64_t gate_in_expert;
  /* Version 20. CUDA: 1 = every forward plans by the three phases (LayerConfig::source_windows false). 0 (the
   * default): a forward that is dropless in one segment, without balancing or nodes, gives each source a fixed
   * window of every owner's token stream and exchanges no counts before its scatter; the same bits. The host
   * backend ignores it (it always takes the three phases). */
  int64_t no_source_windows;
} rdep_layer_spec;

enum rdep_balance_kind { RDEP_BALANCE_OFF = 0, RDEP_BALANCE_ULTRAEP = 1, RDEP_BALANCE_EPLB = 2, RDEP_BALANCE_EPLB_EXACT = 3 };

/* One local rank's arguments to a call. Forward reads num_tokens, experts, gates, x, w1, w2 and writes
 * y; backward reads dy, w1, w2 and writes dx, dgates, dw1, dw2. */
typedef struct rdep_rank_io {
  int64_t num_tokens;
  const int32_t* experts; /* [n][K] */
  const float* gates;     /* [n][K], finite and >= 0 */
  const void* x;          /* [n][H] */
  void* y;                /* [n][H] */
  const void* w1;         /* [E_r][H][2F] */
  const void* w2;         /* [E_r][F][H] */
  const void* dy;         /* [n][H] */
  void* dx;               /* [n][H] */
  float* dgates;          /* [n][K], w.r.t. the gates passed to forward */
  void* dw1;              /* [E_r][H][2F] */
  void* dw2;              /* [E_r][F][H] */
  void* stream;           /* CUDA: the caller's cudaStream_t on the rank's device */
  int32_t grad_bf16;      /* CUDA backward: 1 = dw1, dw2 are bf16 (the gradients of bf16 weights, written once;
                             needs one segment per forward: segment_tokens 0 or >= W*T), 0 = fp32 */
  int32_t reserved;       /* must be 0 */
} rdep_rank_io;

/* Version 3. One local rank's rows for the dispatch/combine calls (the caller's own experts, below).
 * n is the plan's num_tokens, M the rows the rank receives (the sum of rdep_context_recv_counts):
 *   rdep_layer_dispatch:          in = x [n][H]               out = recv [M][H]
 *   rdep_layer_combine:           in = expert outputs [M][H]  out = y [n][H]
 *   rdep_layer_combine_backward:  in = dy [n][H]              out = d_out [M][H], dgates [n][K]
 *   rdep_layer_dispatch_backward: in = d_recv [M][H]          out = dx [n][H]
 * Element types as for rdep_rank_io's activations (host fp32, CUDA bf16); dgates fp32. */
typedef struct rdep_rank_rows {
  const void* in;
  void* out;
  float* dgates;    /* combine_backward only */
  void* stream;     /* CUDA: the caller's cudaStream_t on the rank's device */
  int64_t in_rows;  /* rows of in (n or M as above), checked against the plan */
  int64_t out_rows; /* rows of out */
  int64_t reserved; /* must be 0 */
} rdep_rank_rows;

int32_t rdep_capi_version(void);
const char* rdep_last_error(void);
/* 1 when this library was built with CUDA, and the number of GPUs it sees (0 without CUDA). */
int32_t rdep_built_with_cuda(void);
int32_t rdep_cuda_device_count(void);
/* Version 14. 1 when expert_compute 1 (the CUTLASS grouped GEMMs) runs on CUDA device `device` of this
 * process: a build with CUDA and CUTLASS, an sm_90 GPU. Else 0, and rdep_last_error() says why (no CUDA
 * or no CUTLASS in this build, another architecture, no such device). */
int32_t rdep_cutlass_available(int32_t device);

/* Version 4. Domains, reference-counted: rdep_domain_create returns the caller's reference, every layer
 * created on the domain holds one more, and the domain is freed with the last (so it may be destroyed
 * before or after its layers, in any order). rdep_domain_destroy drops the caller's reference; using
 * that handle afterwards is undefined, as for any freed handle. In the per-process mode creating a
 * domain, and each layer on it, is collective (every process, in the same order); so is destroying a
 * balanced layer: whether the next balanced layer allocates the shared replica slots (a collective)
 * or reuses them depends on the layers this process still holds, so processes that free balanced
 * layers in different orders and then create another can hang. The allgather callback must not
 * destroy a layer of the same domain (the domain's lock is held while it runs). */
int rdep_domain_create(const rdep_domain_spec* spec, rdep_domain** out);
void rdep_domain_destroy(rdep_domain* domain);
int rdep_domain_local_ranks(const rdep_domain* domain, int32_t* first, int32_t* count);
/* The rank's GPU, or -1 on the host backend (rank: one this process drives). */
int rdep_domain_device(const rdep_domain* domain, int32_t rank, int32_t* device);
/* The live layers on the domain. */
int rdep_domain_num_layers(const rdep_domain* domain, int32_t* count);
/* Bytes per rank of the domain's symmetric regions (every layer's, the shared regions counted once),
 * and of its shared regions alone (the replica slots of its balanced layers, one set per slot size, and
 * on the CUDA backend the owner's output rows, one region per row-buffer size; whatever the number of
 * layers). Either pointer may be null. */
int rdep_domain_memory(const rdep_domain* domain, size_t* symmetric_bytes_per_rank, size_t* shared_bytes_per_rank);
/* A printable description (backend, ranks, placement, transport), as rdep_layer_describe. */
int rdep_domain_describe(const rdep_domain* domain, char* buf, size_t cap, size_t* needed);

/* A layer with a domain of its own, made from spec's backend, world_size, num_gpus, process_rank,
 * device, barrier_timeout_s, allgather and allgather_user. */
int rdep_layer_create(const rdep_layer_spec* spec, rdep_layer** out);
/* Version 4. A layer on an existing domain (which it keeps alive). spec's backend and world_size must
 * equal the domain's, and its other domain fields (num_gpus, process_rank, device, barrier_timeout_s,
 * allgather, allgather_user) be 0 or equal to the domain's: otherwise InvalidArgument naming the field. */
int rdep_layer_create_on(rdep_domain* domain, const rdep_layer_spec* spec, rdep_layer** out);
void rdep_layer_destroy(rdep_layer* layer);
/* Version 4. The layer's domain, as a new reference the caller drops with rdep_domain_destroy. */
int rdep_layer_domain(rdep_layer* layer, rdep_domain** domain);
/* Version 4. Bytes per rank of the replica slots this layer uses (weights and gradients; 0 with
 * balancing off). They are the domain's, shared with its other balanced layers of the same slot size:
 * sum them over layers only for layers on different domains (rdep_domain_memory counts them once). */
int rdep_layer_replica_slot_bytes(const rdep_layer* layer, size_t* bytes);
/* Version 7. Bytes per rank of the CUDA layer's shared buffers: the owner's output rows (one segment's
 * expert outputs, and the backward's dout and dx rows), with the CUTLASS compute that compute's SwiGLU
 * scratch (except at W = 1 with one segment a call, where it lives in the return region), and (one domain: nodes 0 or 1) the segment payload, its sideband and the return region; 0 on
 * the host backend. Like the replica slots they are the domain's, one region per size shared by every layer
 * of that size (rdep_domain_memory counts them once). The regions are matched by size separately (a
 * cuBLASLt and a CUTLASS layer of one shape share the transport regions only: the CUTLASS layer's output
 * rows are one set, dx written over dout, the cuBLASLt layer's two): rdep_domain_memory, not a sum of this
 * over layers, is a domain's total. From version 10 it also counts the
 * paged stash's transient rows and pool (stash_rows > 0), shared the same way, and its W outcome words
 * (shared by every stashing layer of the domain). */
int rdep_layer_shared_row_bytes(const rdep_layer* layer, size_t* bytes);
/* Version 8. CUDA: where the saved rows of contexts acquired from now on come from (nearly all of a
 * context's bytes: the front-end's returned rows kept for dgate and, with expert_compute CUTLASS, the
 * owner's x rows, SwiGLU inputs and kept outputs). alloc(user, bytes, device, stream) returns device
 * memory usable in stream order after `stream` (the caller's stream of the call that asks, io.stream),
 * NULL when it has none (the call fails naming the bytes); free(user, ptr, bytes, device) gives a block
 * back, from rdep_context_release, after the last call that used it in that stream's order. With an
 * allocator (PyTorch's caching allocator in rdep.torch) the rows are the caller's memory between a
 * context's release and its next forward; without one (both NULL, the default) they stay with the pooled
 * context. Call while no context of the layer is acquired. The host backend refuses (FailedPrecondition).
 * A released context's rows are taken again on the calling thread before its next forward or plan, so an
 * allocator with no memory fails that call before the collective (in a one-rank-per-process domain the
 * other processes then wait at its first barrier until barrier_timeout_s). Requirements: alloc and free
 * are thread-safe (the ranks' threads may call them at once), never call back into rdep, and outlive the
 * layer and its contexts (destroying the layer frees through them); a context's forward, backward and
 * release use one caller stream (its rows were allocated on it); release a context whose calls a CUDA
 * graph captured only with that graph. */
typedef void* (*rdep_alloc_fn)(void* user, size_t bytes, int32_t device, void* stream);
typedef void (*rdep_free_fn)(void* user, void* ptr, size_t bytes, int32_t device);
int rdep_layer_set_row_allocator(rdep_layer* layer, rdep_alloc_fn alloc, rdep_free_fn free_fn, void* user);
/* Version 15. The bytes one forward asks the row allocator for, summed over the local ranks, each request
 * rounded up to 256 bytes: an allocator that hands out consecutive 256-aligned pieces of one buffer of this
 * size serves a whole forward (rdep.torch's capturable ops take the rows as one tensor PyTorch tracks, as
 * CUDA graph trees require of every allocation in their pool). 0 on the host backend and without an
 * allocator. */
int rdep_layer_row_allocator_bytes(const rdep_layer* layer, size_t* bytes);
/* Version 17. rdep_layer_forward whose contexts' saved rows, those the call reserves, come from the caller's arena
 * rather than from the row allocator: consecutive 256-aligned pieces of [rows, rows + row_bytes) (rows 256-byte
 * aligned), handed out without calling alloc (for rdep.torch a Python callback per request) and never given to free
 * (the caller's buffer holds them: they are forgotten when the context gives its rows back). The arena must stay
 * valid, and untouched by the caller, until the context is released (for a context a CUDA graph recorded, while the
 * graph is replayed). A request that does not fit fails the call naming the bytes; size the arena with
 * rdep_layer_row_allocator_bytes. A context that still holds rows from an earlier forward (not released since)
 * reserves none: it takes nothing from the arena. *used (when not NULL): the bytes the call took. Without a row
 * allocator set (the host backend, or none set) the arena is not used and *used is 0; rows NULL is
 * rdep_layer_forward. rdep.torch's capturable ops pass the rows tensor they return. */
int rdep_layer_forward_arena(rdep_layer* layer, int64_t ctx, const rdep_rank_io* io, int32_t count, void* rows,
                             size_t row_bytes, size_t* used);
/* Version 18. The arena [old_rows, old_rows + row_bytes) whose pieces the forward held in ctx took
 * (rdep_layer_forward_arena) was copied, byte for byte, to new_rows (for rdep.torch, a saved-tensor hook that moved
 * the rows tensor: save_on_cpu, activation offloading): the context's saved rows are read from the same offsets of
 * new_rows from now on, and the old bytes are no longer read. new_rows must be 256-byte aligned and stay valid, as
 * the arena had to, until the context is released. Not for a forward a CUDA graph recorded: its replays read the
 * addresses the capture saw. FailedPrecondition when ctx holds no forward; InvalidArgument for a stale id, a null
 * or misaligned new_rows; the host backend takes no rows from an arena (0, nothing changes). */
int rdep_context_rebase_rows(rdep_layer* layer, int64_t ctx, const void* old_rows, size_t row_bytes, void* new_rows);
/* Version 19. ctx's forward, whose backward already ran, may run a backward again: for a context a CUDA graph
 * recorded, whose forward's replays rewrite its saved state. CUDA graph trees (torch.compile's reduce-overhead)
 * record a second backward node under a replayed forward node when the first one's invariants fail; that
 * recording runs the backward's calls again on the context the forward's capture used, after the forward's replay.
 * On CUDA the backward still checks on the device that a forward ran into the context since the last backward took
 * it (a replay of the forward counts; the backward consumes saved rows, so a second backward of one forward would be
 * wrong): where none did, the rank's error record says so (rdep_layer_check_errors, and every later call) and a
 * captured backward traps, as a failed barrier does. The host backward keeps its saved state: there the forward runs
 * a backward again. 0 also when ctx holds a forward no backward used yet (nothing changes); FailedPrecondition when
 * no forward completed into ctx since it was acquired (or it ran through the dispatch/combine steps); InvalidArgument
 * for a stale id. */
int rdep_context_rearm(rdep_layer* layer, int64_t ctx);
int rdep_layer_local_ranks(const rdep_layer* layer, int32_t* first, int32_t* count);
int rdep_layer_owned_experts(const rdep_layer* layer, int32_t rank, int64_t* first, int64_t* count);
/* The rank's GPU, or -1 on the host backend. */
int rdep_layer_device(const rdep_layer* layer, int32_t rank, int32_t* device);
/* A printable description (config, placement, transport) into buf (truncated to cap, NUL-terminated);
 * *needed gets the full length. */
int rdep_layer_describe(const rdep_layer* layer, char* buf, size_t cap, size_t* needed);

int rdep_context_acquire(rdep_layer* layer, int64_t* ctx);
int rdep_context_release(rdep_layer* layer, int64_t ctx);
/* Bytes the context's saved state holds, summed over local ranks. */
int rdep_context_bytes(const rdep_layer* layer, int64_t ctx, size_t* bytes);
/* Version 14. Waits until the device has checked the routing of the forward held in ctx (every local rank)
 * and returns InvalidArgument naming rank, token, slot and value when a slot was bad (that token ran with
 * zero gates), else 0. A CUDA forward with expert_compute CUTLASS and no balancing does not wait: it reports
 * a bad slot itself only when the device has checked it by the time the call returns, and its backward
 * reads the record again without waiting (after the collective); a caller that will not run the backward
 * (grad off) calls this before releasing the context. Not a collective: it waits for the rank's stream up
 * to the forward's check (no time limit beyond the work queued before it), holding the layer's context
 * lock, so call it from the thread that makes the layer's calls. A forward recorded in a CUDA-graph capture
 * has its record written by the graph's replays: check it after a replay. FailedPrecondition when ctx holds
 * no forward (none ran, or its backward did); InvalidArgument for a stale id; the host backend checks in
 * the forward (0). */
int rdep_context_check_routing(rdep_layer* layer, int64_t ctx);
/* Version 16. Reads the error records the device barriers of the layer's local ranks write (mapped host memory:
 * no CUDA call, no wait) and returns the first failure as its status (Timeout: a barrier no peer reached, naming the
 * phase, its sequence number and the missing rank; Internal: a phase mismatch, or epochs that diverged; since version
 * 19 FailedPrecondition: a backward that found no forward in its context, see rdep_context_rearm), else 0, each
 * prefixed with its rank.
 * Every call of the layer checks these records first; a layer whose calls a CUDA graph replays makes no call, and a
 * barrier recorded in a graph that fails in a replay traps after writing its record (the CUDA context stops): this
 * call then says why. Not a collective; safe once the context stopped. The host backend has no records (0). */
int rdep_layer_check_errors(rdep_layer* layer);

/* Collective: io[count] for the local ranks in order (count must equal the local rank count). */
int rdep_layer_forward(rdep_layer* layer, int64_t ctx, const rdep_rank_io* io, int32_t count);
int rdep_layer_backward(rdep_layer* layer, int64_t ctx, const rdep_rank_io* io, int32_t count);

/* Version 3. The caller's own experts (dispatch / combine, in the manner of DeepEP's Buffer API), each
 * call collective like forward, every process calling the same steps in the same order:
 *   rdep_layer_plan(ctx, io)           routing (io: num_tokens, experts, gates, stream): the counts,
 *                                      the owners' capacity decision and the accepted set, into ctx
 *   rdep_context_recv_counts(ctx, r)   the rows rank r receives per local expert (after plan; on CUDA
 *                                      it synchronizes the rank's stream); M = their sum
 *   rdep_layer_dispatch(ctx, rows)     each owner's admitted rows, expert-major over its local experts,
 *                                      within an expert by source rank, token, slot
 *   ... the caller computes one output row per received row ...
 *   rdep_layer_combine(ctx, rows)      y_t = sum_k g'_k out(t, k) (fixed slot order, fp32 accumulation)
 *   rdep_layer_combine_backward        d_out = g'_k dy_t per received row; dgates w.r.t. the gates of plan
 *   rdep_layer_dispatch_backward       dx_t = sum_k d_recv(t, k); it ends the context's use (as backward)
 * rdep_context_recv_row_ids(ctx, r) gives each received row's id ((source rank * T + token) * K + slot)
 * after dispatch. Not with balancing or nodes; on CUDA only with one segment per forward
 * (segment_tokens 0 or >= W*T). A step out of order is an error naming it. */
int rdep_layer_plan(rdep_layer* layer, int64_t ctx, const rdep_rank_io* io, int32_t count);
int rdep_context_recv_counts(rdep_layer* layer, int64_t ctx, int32_t rank, int64_t* counts, int64_t num_counts);
int rdep_context_recv_row_ids(rdep_layer* layer, int64_t ctx, int32_t rank, int64_t* ids, int64_t num_ids);
int rdep_layer_dispatch(rdep_layer* layer, int64_t ctx, const rdep_rank_rows* rows, int32_t count);
int rdep_layer_combine(rdep_layer* layer, int64_t ctx, const rdep_rank_rows* rows, int32_t count);
int rdep_layer_combine_backward(rdep_layer* layer, int64_t ctx, const rdep_rank_rows* rows, int32_t count);
int rdep_layer_dispatch_backward(rdep_layer* layer, int64_t ctx, const rdep_rank_rows* rows, int32_t count);

/* Version 21. AdamW over bf16 parameters with fp32 master weights (rdep.torch.MasterAdamW; the update is
 * torch.optim.AdamW's, written out in rdep/optim/master_adamw.h): for each tensor the fp32 master weight,
 * exp_avg and exp_avg_sq are updated in place from the gradient (bf16, or from version 22 fp32 as grad_dtype
 * says: a gradient accumulated in fp32 over micro-batches; times *grad_scale when grad_scale is
 * not null: e.g. a gradient-norm clip's coefficient, left on the device), and param receives the master
 * weight rounded to bf16. step is this update's count (1 for the first), which the bias corrections use.
 * device -1: every pointer (grad_scale too) is host memory and the update runs on the calling thread;
 * else every pointer is memory of CUDA device `device`, the update is queued on `stream` (a cudaStream_t
 * on that device, 0 for the legacy default stream) and the call returns without waiting. Everything is
 * checked (hyperparameter ranges, numel, null or overlapping arrays, naming the tensor) before any tensor
 * is touched. */
#define RDEP_ADAMW_GRAD_BF16 0
#define RDEP_ADAMW_GRAD_FP32 1
typedef struct rdep_adamw_tensor {
  float* master;      /* fp32 [numel] */
  float* exp_avg;     /* fp32 [numel] */
  float* exp_avg_sq;  /* fp32 [numel] */
  const void* grad;   /* bf16 or fp32 [numel], as grad_dtype says */
  void* param;        /* bf16 [numel] */
  int64_t numel;
  int32_t grad_dtype; /* version 22: RDEP_ADAMW_GRAD_BF16 or RDEP_ADAMW_GRAD_FP32 */
} rdep_adamw_tensor;
typedef struct rdep_adamw_step {
  double lr; /* the hyperparameters in double, as torch's (1 - beta2 and the bias corrections are taken in double) */
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int32_t device; /* -1: host memory; else the CUDA device of every pointer */
  int64_t step;
  const float* grad_scale; /* null, or one fp32 value */
  void* stream;
} rdep_adamw_step;
int rdep_master_adamw(const rdep_adamw_tensor* tensors, int32_t count, const rdep_adamw_step* step);

/* Version 23. A bf16 gradient moved into an fp32 accumulator (rdep.torch.MasterAdamW(fp32_grads=True)'s hook, per
 * micro-batch; rdep/optim/grad_accumulate.h): add 0: acc[i] = float(grad[i]); add 1: acc[i] = acc[i] + float(grad[i])
 * in one fp32 rounding (torch's acc.add_(grad) bit for bit). device -1: host memory, done on the calling thread;
 * else both arrays are memory of CUDA device `device` and the move is queued on `stream` (a cudaStream_t on that
 * device, 0 for the legacy default stream) without waiting. numel < 0, null arrays (numel > 0), acc and grad
 * overlapping, add other than 0 or 1, or memory of another device is an error naming it; nothing is touched then. */
int rdep_grad_accumulate(float* acc, const void* grad, int64_t numel, int32_t add, int32_t device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* RDEP_CAPI_H_ */
