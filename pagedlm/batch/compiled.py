"""A compiled CPU decode step: ``CompiledDecode`` (``--compile``).

An eager CPU decode step of a small model is a thousand small torch calls
(norms, RoPE, casts, residual adds, the products), each paying the host's
dispatch. ``torch.compile`` (inductor's CPU backend, which writes and builds
C++) turns the model's forward and its output head into one graph: the
pointwise work between two products fuses into one loop, and the step is
one call with one set of guards. The products: float32 ones are MKL's
(``kernels.cpu.linear``), int4 and int8 ones the integer kernel's op
(``pagedlm::cpu_quant_mm``, ``kernels.cpu_quant``); without that kernel, int4
ones are torch's int4 kernel and a one-row int8 product becomes a loop of
inductor's own over the codes (``QuantizedWeight.linear``, ``inductor_options``).

Attention: in the one-row graph it is inside. The store reserves each
layer's slot for the step's token eagerly (``KVStore.reserve_decode``:
the per-row caches grow and their rings turn in their own Python) and hands
the graph views of exactly the keys the token attends to; their lengths are
dynamic dimensions (one symbol each, duck sizing off), so keys that grow
never recompile. The graph writes the new key and value into their slot in
place (``index_copy_``) and attends over the views (``_RowKV``). The 2 to
``MAX_ROWS`` row graph still sends each layer's attention to the store
through one opaque custom op (``pagedlm::write_attend``: its inputs would
otherwise be per row). The graph reads RoPE's table at a fixed bound
(``max_model_len``, as the CUDA graphs do) so that it never grows under it.

Shape classes: one graph for a batch of one, one for 2 to ``MAX_ROWS``
decode rows (their count a dynamic dimension). Both compile when the engine
starts (``warm_up``), never on a request's path; inductor keeps what it
builds under ``~/.cache/pagedlm/inductor`` (``$PAGEDLM_CACHE_DIR/inductor``),
so a later process on the same model and torch reuses it.

Which steps it runs: every row decodes one token and samples, at most
``MAX_ROWS`` rows (a step with a prompt chunk or a speculative verify row
runs eagerly). Float32 logits equal the eager step's within 1e-4 (the fused
loops sum in another order; the residual adds stay out of the products,
``ResidualOutsideGemm``); quantized ones differ a little more where the
int8 loop reads float32 activations and the eager kernel rounds them to
bfloat16 (``tests/weights/test_compiled_models.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import warnings
import weakref
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from pagedlm.attention.sdpa import attend_rows
from pagedlm.cache.step import StepBatch
from pagedlm.kernels import cpu_quant
from pagedlm.kernels.quant import QuantizedWeight
from pagedlm.options import cache_dir

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore

MAX_ROWS = 32  # more decode rows than this are a GEMM-shaped step: eager (its fixed costs amortise)
# Every engine's graphs hang on one function's code, two per model (and
# dtype, quantization): more than dynamo's default of 8 in a process that
# compiles several models (a bench of every mode, a test run).
RECOMPILE_LIMIT = 64
# The engines whose graphs run now, by number: the custom op finds its store
# and step here (its arguments can only be tensors and scalars). The number
# is a tensor input of the graph: the graph does not depend on the engine.
_RUNNING: "weakref.WeakValueDictionary[int, CompiledDecode]" = weakref.WeakValueDictionary()
_NUMBERS = count()


@torch.library.custom_op("pagedlm::write_attend", mutates_args=())
def write_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, engine: torch.Tensor,
                 layer: int, scale: float) -> torch.Tensor:
    """``kv.write(layer, keys, values, step)`` then ``kv.attend(layer, q, step)``
    on the running step of engine number ``engine``, eagerly."""
    run = _RUNNING[int(engine)]
    run.store.write(layer, keys, values, run.step)
    return run.store.attend(layer, q, run.step, scale=scale)


@write_attend.register_fake
def _(q, keys, values, engine, layer, scale):
    return torch.empty_like(q)


class _RowKV:
    """The ``KVAccess`` of the one-row graph: attention inside it. Each
    layer's keys and values are the views the store reserved for the step
    (``KVStore.reserve_decode``; their lengths dynamic dimensions): the new
    key and value go to their slot in place, then attention reads the view:
    ``kernel``, the integer kernel library's ``decode_attention`` op for
    float32 keys (split over KV heads and blocks of keys on both threads,
    vectorised with AVX-512: ~65 us a layer at 512 keys of SmolLM2 in the
    step, where SDPA's CPU kernel took ~115), else SDPA."""

    def __init__(self, views: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, kernel: bool) -> None:
        self.views, self.slots, self.kernel = views, slots, kernel

    def write_target(self, layer: int, step: StepBatch) -> None:
        return None  # (keys and values go to the reserved views: `write`)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: StepBatch) -> None:
        k, v = self.views[layer]
        slot = self.slots[layer : layer + 1]
        k.index_copy_(0, slot, keys)
        v.index_copy_(0, slot, values)

    def attend(self, layer: int, q: torch.Tensor, step: StepBatch, *, scale: float) -> torch.Tensor:
        k, v = self.views[layer]
        if self.kernel and k.dtype == torch.float32:
            return torch.ops.pagedlm.decode_attention(q, k, v, scale)
        return attend_rows(q, k[None], v[None], None, scale)


class _GraphKV:
    """The ``KVAccess`` the compiled graph sees: a layer's ``write`` is held
    until its ``attend``, and both become one ``write_attend``."""

    def __init__(self, number: int) -> None:
        self.number = torch.tensor(number)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write_target(self, layer: int, step: StepBatch) -> None:
        return None  # (write_attend takes the keys and values)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: StepBatch) -> None:
        self.held[layer] = (keys, values)

    def attend(self, layer: int, q: torch.Tensor, step: StepBatch, *, scale: float) -> torch.Tensor:
        keys, values = self.held.pop(layer)
        return torch.ops.pagedlm.write_attend(q, keys, values, self.number, layer, scale)


def use_cache_dir() -> str:
    """Point inductor's cache at ``$PAGEDLM_CACHE_DIR/inductor`` (default
    ``~/.cache/pagedlm/inductor``), unless ``TORCHINDUCTOR_CACHE_DIR`` names
    another folder than torch's default (a folder under /tmp, which a reboot
    empties); returns the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class ResidualOutsideGemm(CustomGraphPass):
    """Undo inductor's CPU fusion of a residual add into the product before
    it, ``x + a @ w`` -> ``addmm(x, a, w)``, where ``x`` has the product's
    whole shape (a residual stream; a bias vector stays fused). With our
    K-major weights MKL accumulates into ``x``, rounding partial sums at the
    residual's magnitude: SmolLM2's residual stream holds values near 3.8e3
    (a float32 ulp of 2.4e-4 there). One [1, 1536] x [1536, 576] product
    onto a residual of that size is 2e-2 from float64 fused against 5e-4
    unfused, and the fused step's logits were 3-8x further from a float64
    run than the eager step's (up to 2.6e-4 against 3.3e-5; AMD EPYC, 2
    threads). Unfused, the add joins the norm's loop after it, as inductor
    does on the GPU (``should_prefer_unfused_addmm``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in graph.find_nodes(op="call_function", target=aten.addmm.default):
            x, a, b = node.args
            if node.kwargs or x.meta["val"].shape != node.meta["val"].shape:
                continue
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (a, b))
                total = graph.call_function(aten.add.Tensor, (x, product))
            product.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
            total.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(total)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """Part of every cached graph's key: the whole package's source. A
        cached graph carries the guards its trace added, and code that only
        changes a guard (a row count tested before a branch not taken) leaves
        the graph, hence the key, as it was: a stale entry's guard then
        contradicts the step's dynamic rows and the warm-up fails."""
        return _package_hash()


@functools.cache
def _package_hash() -> bytes:
    root = Path(__file__).resolve().parent.parent
    return get_hash_for_files(tuple(str(f) for f in sorted(root.rglob("*.py"))))


def inductor_options(model: torch.nn.Module) -> dict:
    """The residual adds stay out of the products (``ResidualOutsideGemm``).
    An int8 weight on torch's path (no ``kernels.cpu_quant`` tiles): every
    pointwise result becomes a buffer. Its one-row product in the graph is a
    reduction over the codes (``QuantizedWeight.linear``), and inductor would
    otherwise recompute the norm or activation that feeds it once per output
    row (measured on SmolLM2, 2 threads: int8 1.24 -> 1.39x eager, int4 with
    its int8 head 1.06 -> 1.32x). Library calls (float32's MKL product, the
    integer kernel's op) read buffers anyway, and there the same setting
    costs: 3% on float32 (1.17 -> 0.97x), 2-4% on SmolLM2 int4 with the
    integer kernel (116.0 -> 120.5 tok/s at prompt 64, 74.9 -> 76.7 at 512,
    same process): left alone.

    No ``size_asserts``: the graph's wrapper would check the size and
    strides of each input at every call (~640 a step on SmolLM2, its
    weights among them), which dynamo's guards have checked already:
    SmolLM2 int4 one-row steps 1.05-1.06x at 64 keys, 1.02-1.06x at 512
    (`benchmarks/cpu_inductor_ab.py`, same process, alternating rounds)."""
    looped = any(isinstance(m, QuantizedWeight) and m.mode == "int8" and not hasattr(m, "tiles")
                 for m in model.modules())
    options = {"post_grad_custom_post_pass": ResidualOutsideGemm(), "size_asserts": False}
    return (options | {"realize_opcount_threshold": 0}) if looped else options


class CompiledDecode:
    """The engine's decode step as compiled graphs (the CPU's counterpart of
    ``graphs.DecodeGraphs``, with the same ``can_run`` / ``run``)."""

    def __init__(self, model: torch.nn.Module, store: "KVStore", max_num_seqs: int, max_model_len: int) -> None:
        self.model, self.store, self.max_rows = model, store, min(max_num_seqs, MAX_ROWS)
        self.number = next(_NUMBERS)
        self.step: StepBatch | None = None  # the step running now, for write_attend
        kv = _GraphKV(self.number)
        # What the model reads of the step in the graph: RoPE's bound, fixed.
        bound = StepBatch(None, None, None, None, None, None, (), (), (), (), max_model_len - 1)
        kernel = cpu_quant.library()  # the one-row graph's attention: its decode_attention op, else SDPA

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, kv, bound))

        def forward_one(input_ids: torch.Tensor, positions: torch.Tensor, views: list, slots: torch.Tensor):
            return model.compute_logits(model(input_ids, positions, _RowKV(views, slots, kernel), bound))

        self.bound = bound
        options = inductor_options(model)
        self._graph = torch.compile(forward, dynamic=False, options=options)
        self._one = torch.compile(forward_one, dynamic=False, options=options)
        _RUNNING[self.number] = self
        self.warm_up()

    def warm_up(self) -> None:
        """Compile the graphs now, on throwaway rows of the store: first one
        eager step at RoPE's bound (its table grows outside the graph), then
        a batch of one and of two through the graph."""
        t0 = time.perf_counter()
        print(f"pagedlm: compiling the CPU decode step (once per model; cached in {use_cache_dir()})",
              file=sys.stderr, flush=True)
        eager = lambda step: self.model(step.input_ids, step.positions, self.store,  # noqa: E731
                                        dataclasses.replace(step, max_position=self.bound.max_position))
        with warnings.catch_warnings():
            # dynamo traces through functools.lru_cache (gemma3._embed_scale): a pure function, same value
            warnings.filterwarnings("ignore", message=".*lru_cache.*", category=UserWarning)
            self._throwaway_step(1, eager)  # RoPE's table at its bound
            self._throwaway_step(1, self.run, prompt=eager)  # keys of two tokens first: lengths of 3
            if self.max_rows > 1:
                self._throwaway_step(2, self.run)
        print(f"pagedlm: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def _throwaway_step(self, n: int, forward, prompt=None) -> None:
        """``n`` new rows decode one token through ``forward``; with ``prompt``
        (one row), after two tokens that ``prompt`` stores for it."""
        device = next(self.model.parameters()).device
        rows = tuple(range(-n, 0))  # ids no sequence has
        for seq_id in rows:
            self.store.add_row(seq_id)
        start = 0 if prompt is None else 2
        zeros = lambda k=n: torch.zeros(k, dtype=torch.long, device=device)  # noqa: E731 (distinct: no aliasing guard)
        step = StepBatch(input_ids=zeros(), positions=zeros() + start, seq_lens=zeros() + start + 1,
                         logits_rows=torch.arange(n, device=device), slot_mapping=None, block_tables=None,
                         seq_ids=rows, query_start_host=tuple(range(n + 1)), seq_lens_host=(start + 1,) * n,
                         sampling_rows=tuple(range(n)), max_position=start)
        try:
            with torch.inference_mode():
                if prompt is not None:
                    prompt(StepBatch(input_ids=zeros(2), positions=torch.arange(2, device=device), seq_lens=zeros(1) + 2,
                                     logits_rows=torch.ones(1, dtype=torch.long, device=device), slot_mapping=None,
                                     block_tables=None, seq_ids=rows, query_start_host=(0, 2), seq_lens_host=(2,),
                                     sampling_rows=(0,), max_position=1))
                    self.store.end_step()
                forward(step)
        finally:
            self.store.end_step()
            for seq_id in rows:
                for cache in self.store.pop_row(seq_id):
                    if cache is not None:
                        cache.dispose()

    def can_run(self, step: StepBatch) -> bool:
        n = len(step.seq_ids)
        return step.num_tokens == n == len(step.sampling_rows) and n <= self.max_rows

    def run(self, step: StepBatch) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step of ``n`` rows (``can_run``)."""
        if len(step.seq_ids) == 1:
            views, slots = self.store.reserve_decode(step)
            for k, v in views:  # the keys' lengths grow: dynamic, one symbol each (no duck sizing)
                torch._dynamo.mark_dynamic(k, 0)
                torch._dynamo.mark_dynamic(v, 0)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, capture_scalar_outputs=True), \
                    torch.fx.experimental._config.patch(use_duck_shape=False):
                return self._one(step.input_ids, step.positions, views, slots)
        self.step = step
        try:
            # one graph for every batch of 2 to MAX_ROWS rows
            torch._dynamo.mark_dynamic(step.input_ids, 0, min=2, max=self.max_rows)
            torch._dynamo.mark_dynamic(step.positions, 0, min=2, max=self.max_rows)
            # capture_scalar_outputs: Gemma's embedding scale is a tensor's .item()
            # (gemma3._embed_scale), a graph break at the first layer otherwise.
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, capture_scalar_outputs=True):
                return self._graph(step.input_ids, step.positions)
        finally:
            self.step = None
