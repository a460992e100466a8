"""The tags every rdep custom op is registered with.

`torch.Tag.cudagraph_unsafe`: each rdep op does host work that must run on every call (it acquires and
releases the layer's forward contexts, keeps their tokens, calls the C library, which picks the context's
buffers), so a CUDA graph that replayed only its kernels would reuse one call's state for every replay.
With the tag, torch.compile(mode="reduce-overhead") runs the ops outside its CUDA graphs: with inductor's
graph partitioning (torch._inductor.config.graph_partition) the rest of the compiled graph is captured in
partitions around them; without it, a graph holding an rdep op is not captured. torch releases whose
custom_op takes no tags (or that lack the tag) register the ops without it.
"""

from __future__ import annotations

import inspect

import torch

_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
_takes_tags = "tags" in inspect.signature(torch.library.custom_op).parameters

# Keyword arguments for torch.library.custom_op: {"tags": (...)} where supported, else nothing.
CUSTOM_OP_TAGS: dict = {"tags": (_tag,)} if (_tag is not None and _takes_tags) else {}
