"""The lean target's few-token forwards at fixed shapes, captured as CUDA graphs on a GPU.

Why: an 8B step launches ~1,150 kernels; on a GPU their launch overhead, not the weights' stream,
sets the pace. A CUDA graph replays them with one launch, but only for fixed shapes and addresses:
so the cache is allocated to its full length once (`context`), positions live on the device, and
attention reads a fixed bucket of cache slots (a power of two) under a mask instead of a Python
slice. One graph per (rows, bucket, chain or tree, cache), captured on first use; rows up to
MAX_ROWS cover a step, every chain verify and the trees the presets draw. A prompt's prefill stays
eager (its length varies).

On a CPU the same static forward runs eagerly when asked (`capture=False`): that is how the tests
check it against the dynamic forward, and how a GPU run's graphs-off figure is taken. Graphs are
off on CPUs, where launches cost nothing and the extra masked keys cost a little.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layer import attend
from .primitives import rms

MAX_ROWS = 17                       # a step, a verify of up to 16 drafted tokens, a 16-node tree plus its root
KEPT_GRAPHS = 64                    # graphs alive at once (least recently used dropped): bounded memory
CONTEXT = int(os.environ.get("DYNCHAT_GRAPH_CONTEXT", "8192"))    # slots allocated up front per cache


def graphs_wanted(device: torch.device) -> bool:
    """CUDA graphs for the target's steps: on CUDA unless DYNCHAT_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("DYNCHAT_CUDA_GRAPHS", "1") != "0"


@dataclass
class _Inputs:
    """A graph's input and output buffers: replays read and write these addresses."""
    ids: torch.Tensor               # (n,) token ids
    start: torch.Tensor             # (1,) the first new token's cache slot
    positions: torch.Tensor | None  # (n,) rotary positions of a tree's nodes (a chain's are its slots)
    tree: torch.Tensor | None       # (n, n) which new tokens each may attend to
    logits: torch.Tensor | None = None


class StaticSteps:
    def __init__(self, lm, capture: bool):
        self.lm, self.capture = lm, capture
        self.context = min(CONTEXT, lm.max_length)
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._pool = None

    def takes(self, start: int, n: int, tree: bool) -> bool:
        """Whether a forward of n tokens at cache slot `start` runs here (not a prefill, fits the buffers)."""
        return start > 0 and n <= MAX_ROWS and start + n <= self.context

    def bucket(self, end: int) -> int:
        """Cache slots attention reads: the next power of two >= end, at least 256, at most the context."""
        return min(self.context, max(256, 1 << (end - 1).bit_length()))

    def forward(self, ids: torch.Tensor, start: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None,
                last_only: bool) -> torch.Tensor:
        lm, n = self.lm, ids.numel()
        cache = lm.cache
        cache.ensure(self.context)
        tree = tree_mask is not None
        # a graph replays raw addresses: it serves the cache whose tensors live at the addresses it
        # was captured with (another conversation's cache gets its own graphs; a cache freed and
        # another allocated at the same addresses with the same shapes is served correctly)
        buffers = (cache.k, cache.v, cache.cos, cache.sin, cache.features)
        key = (n, self.bucket(start + n), tree, cache.capacity,
               tuple((t.data_ptr(), t.shape[-1]) if t is not None else None for t in buffers))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._new(key)
        else:
            self._graphs.move_to_end(key)
        graph, inputs = entry
        inputs.ids.copy_(ids)
        inputs.start.fill_(start)
        if tree:
            inputs.positions.copy_(positions)
            inputs.tree.copy_(tree_mask)
        if graph is None:
            self._body(inputs, key[1])
        else:
            graph.replay()
        lm.length = start + n
        return (inputs.logits[-1:] if last_only else inputs.logits).clone()

    def _new(self, key: tuple):
        n, bucket, tree = key[:3]
        device = self.lm.device
        inputs = _Inputs(torch.zeros(n, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device),
                         torch.zeros(n, dtype=torch.long, device=device) if tree else None,
                         torch.zeros(n, n, dtype=torch.bool, device=device) if tree else None)
        graph = None
        if self.capture:
            graph = self._capture(inputs, bucket)
            while len(self._graphs) >= KEPT_GRAPHS:
                self._graphs.popitem(last=False)
            self._graphs[key] = (graph, inputs)
        return graph, inputs

    def _capture(self, inputs: _Inputs, bucket: int):
        """Run the body once on a side stream (kernels pick their workspaces), then record it. The
        buffers hold placeholders here: a capture computes nothing, and the warm-up's writes land
        in cache slots the caller is about to overwrite."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            inputs.start.fill_(self.lm.length)
            self._body(inputs, bucket)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._body(inputs, bucket)
        return graph

    @torch.inference_mode()
    def _body(self, inputs: _Inputs, bucket: int) -> None:
        """The forward with every shape fixed: new rows' keys and values written at their slots,
        attention over the first `bucket` slots under a mask built from device tensors."""
        lm, cache = self.lm, self.lm.cache
        n = inputs.ids.numel()
        rows = torch.arange(n, device=lm.device)
        slots = inputs.start + rows                                     # (n,)
        positions = slots if inputs.positions is None else inputs.positions
        keys = torch.arange(bucket, device=lm.device)
        if inputs.tree is None:
            mask = keys[None] <= slots[:, None]
        else:                          # the prefix, then the nodes the tree mask names
            rel = keys - inputs.start
            in_tree = (rel >= 0) & (rel < n)
            mask = (rel < 0)[None] | (inputs.tree[:, rel.clamp(0, n - 1)] & in_tree[None])
        cos, sin = cache.cos.index_select(0, positions)[:, None], cache.sin.index_select(0, positions)[:, None]

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            cache.k[i].index_copy_(1, slots, k.transpose(0, 1))
            cache.v[i].index_copy_(1, slots, v.transpose(0, 1))

        def attention(q: torch.Tensor, i: int) -> torch.Tensor:
            return attend(q, cache.k[i:i + 1, :, :bucket], cache.v[i:i + 1, :, :bucket], mask)

        captured: list = []
        x = lm.layers(F.embedding(inputs.ids, lm.embed), cos, sin, lm.linear, write, attention, captured)
        if captured:
            cache.features.index_copy_(0, slots, torch.cat([t for _, t in sorted(captured, key=lambda c: c[0])], -1))
        logits = lm.linear(rms(x, lm.norm, lm.eps), lm.head)
        if inputs.logits is None:
            inputs.logits = logits
        else:
            inputs.logits.copy_(logits)
