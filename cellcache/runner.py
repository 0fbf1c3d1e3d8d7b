"""The model runner: one forward per prepared step, and the one place that decides how it
runs and owns what that needs (CUDA graphs, the input buffers, their feeds)::

    host ids ─► pinned staging ─┐
    the last step's draws ──────┴► input_ids (fixed address) ─► forward at step.pad_to:
        decode step at a bucket        replay its decode graph (captured on first use or
                                       by warmup); it leaves its greedy ids in input_ids
        mixed step at a token bucket   replay its mixed graph (logit rows in a device buffer)
        anything else                  the model, eagerly (or compiled)
    ─► float32 logits of the chosen rows (and a graph's greedy ids: ModelRunner.greedy)

The runner never touches the model's attention setting: a :class:`ModelAdapter`
(:class:`cellcache.hf.HFAdapter` for transformers) switches and checks it and runs one
forward with cellcache's attention. :func:`cellcache.hf.attach` builds both; a
:class:`cellcache.generate.Generator` asks its runner how each step runs
(:meth:`ModelRunner.padding`), feeds it (:meth:`ModelRunner.gather`) and warms it up
(:meth:`ModelRunner.warmup`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from . import torch as cct
from ._checks import check_int
from .buckets import bucket_for, check_buckets, default_buckets, default_mixed_buckets
from .cache import CellCache, Step
from .config import CacheConfig
from .errors import InvalidArgument, InvalidState, OutOfMemory
from .native import logits_out

__all__ = ["ATTENTION_BACKENDS", "COMPILE_OPTIONS", "ModelAdapter", "ModelRunner", "check_options",
           "compile_options", "release_compile_workers"]

#: What ``attention=`` takes (see :class:`ModelRunner`).
ATTENTION_BACKENDS = ("auto", "flashinfer")
#: The ``torch.compile`` keywords ``compile=`` takes as a mapping.
COMPILE_OPTIONS = ("backend", "mode", "dynamic", "fullgraph", "options")
#: Compile modes that capture CUDA graphs themselves (a second owner of the decode graphs).
_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_options(compile: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of a ``compile=`` argument: None for False, ``{}`` for
    True (inductor; :class:`ModelRunner` adds ``dynamic=True`` where ``dynamic`` is not
    given), a copy of a mapping whose keys are among :data:`COMPILE_OPTIONS`;
    InvalidArgument for anything else."""
    if isinstance(compile, (bool, np.bool_)):
        return {} if compile else None
    if not isinstance(compile, Mapping):
        raise InvalidArgument(f"compile of type {type(compile).__name__} is not a bool or a mapping "
                              f"of torch.compile options ({', '.join(COMPILE_OPTIONS)})")
    unknown = sorted(str(k) for k in compile if k not in COMPILE_OPTIONS)
    if unknown:
        raise InvalidArgument(f"compile options {', '.join(unknown)} are unknown; give "
                              f"{', '.join(COMPILE_OPTIONS)}")
    options = dict(compile)
    backend = options.get("backend", "inductor")
    if not (isinstance(backend, str) and backend) and not callable(backend):
        raise InvalidArgument(f"compile backend {backend!r} is not a backend name or a callable")
    mode = options.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise InvalidArgument(f"compile mode of type {type(mode).__name__} is not a string or None")
    if not isinstance(options.get("dynamic"), (bool, np.bool_, type(None))):
        raise InvalidArgument(f"compile dynamic of type {type(options['dynamic']).__name__} is not "
                              "a bool or None")
    if not isinstance(options.get("fullgraph", False), (bool, np.bool_)):
        raise InvalidArgument(f"compile fullgraph of type {type(options['fullgraph']).__name__} is "
                              "not a bool")
    if options.get("options") is not None and not isinstance(options["options"], Mapping):
        raise InvalidArgument(f"compile options['options'] of type {type(options['options']).__name__} "
                              "is not a mapping")
    return options


def check_options(compile: Any, attention: Any) -> dict[str, Any] | None:
    """The runner's ``compile`` (:func:`compile_options`) and ``attention`` arguments checked,
    before anything is built: the ``torch.compile`` keywords, or None; InvalidArgument for
    a value the runner does not take."""
    options = compile_options(compile)
    if attention not in ATTENTION_BACKENDS:
        raise InvalidArgument(f"attention={attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return options


def release_compile_workers() -> None:
    """Shuts down inductor's compile-worker pool (``torch.compile``'s subprocesses and the
    threads that tend them), which it keeps alive after compiling. A decode loop never
    compiles once the graphs are captured, and the idle pool slows every host phase of
    serving (docs/design.md has the figure). A later compile (a new shape, another model)
    starts a pool again. Nothing happens on a torch without the function."""
    try:
        from torch._inductor import async_compile
    except ImportError:                       # pragma: no cover - a torch without inductor
        return
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if callable(shutdown):
        shutdown()


def _int_array(values: Any, name: str) -> np.ndarray:
    """``values`` (a sequence, array or tensor of ints) as a 1-D int64 array; an empty one
    is fine."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes)):
        arr = None
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        what = (f"a {arr.ndim}-D array of {arr.dtype}" if arr is not None
                else f"of type {type(values).__name__}")
        raise InvalidArgument(f"{name} is {what}; give a 1-D sequence of ints")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63:
        raise InvalidArgument(f"{name} holds {int(arr.max())}, outside int64")
    return arr.astype(np.int64)


def _bucket_list(widths: Any, buckets: list[int], name: str) -> list[int]:
    """``widths`` (a sequence of ints, each one of ``buckets``) sorted, without repeats."""
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence):
        raise InvalidArgument(f"{name} of type {type(widths).__name__} is not a list of buckets")
    out = []
    for w in widths:
        w = check_int(w, "width", 1)
        if w not in buckets:
            raise InvalidArgument(f"{name}: width {w} is not one of the runner's buckets {buckets}")
        out.append(w)
    return sorted(set(out))


class ModelAdapter(Protocol):
    """What a :class:`ModelRunner` asks of the model it runs (:class:`cellcache.hf.HFAdapter`
    is the transformers one)."""

    def vocab(self) -> int:
        """Rows of the model's input embedding: token ids are in ``[0, vocab)``."""
        ...

    def attention_paths(self, config: CacheConfig) -> list[str]:
        """Each layer's attention path on a paged CUDA cache of ``config``
        (:func:`cellcache.cuda.kernels.choose_path`); InvalidArgument when a layer has none."""
        ...

    def attach(self, view: cct.TorchView) -> None:
        """Switches the model (back) to cellcache's attention over ``view``, checked by a
        probe forward that writes nothing; a refusal (InvalidArgument) leaves the model's
        attention setting as it was."""
        ...

    def check(self) -> None:
        """InvalidState when the model's attention was switched away after :meth:`attach`."""
        ...

    def run(self, forward: Callable[..., Any], view: cct.TorchView, step: Step, backend: str,
            input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``forward`` (the model, or its compiled wrapper) on ``[1, T]`` ``input_ids`` and
        ``positions`` with cellcache's attention over ``step`` (on ``backend``); the logits
        of ``rows`` (None: every row), ``[rows, vocab]``. InvalidState when a layer's
        attention did not run through the cache."""
        ...


class ModelRunner:
    """Runs a model's forward for a prepared step: tokens in, logits of chosen rows out.

    On CUDA with the paged view, decode steps (every row its sequence's next token) whose
    padded width is a bucket replay a CUDA graph captured once per bucket. Mixed steps
    (prompt chunks beside decode rows) padded to a token-count bucket of ``mixed_buckets``
    (default :func:`cellcache.buckets.default_mixed_buckets`; ``[]``: none) replay a graph
    per bucket too, whose attention reads the device-built work list and whose logits come
    for up to :attr:`logit_cap` rows given in a fixed device index buffer; a step with more
    logit rows, or a width at no bucket, runs eagerly. A
    model whose layers fall back to FlashInfer or SDPA (a head_dim or group cellcache's
    kernels do not take) runs every step eagerly. When a copy growth
    moves the pools, the next forward rebuilds the views and drops the graphs (recaptured
    on their next use).

    Build it with :func:`cellcache.hf.attach` (``adapter``: the model's
    :class:`ModelAdapter`). If the model's attention is switched away afterwards
    (``model.set_attn_implementation("sdpa")``), :meth:`forward` refuses (InvalidState)
    until :meth:`reattach` switches it back.

    Feeds: host ids go up through a pinned buffer without blocking the host; a decode
    graph leaves its greedy ids in the input for the next decode step of the same rows;
    :meth:`gather` picks a step's ids out of the previous step's draws on the device. The
    steps run on :attr:`stream`, the device's current stream when the runner is built.

    ``attention``: ``"auto"`` (default: cellcache's kernels, chosen per layer shape) or
    ``"flashinfer"`` (every layer through FlashInfer's paged kernels over the same paged
    view, planned on the host each step, so every step runs eagerly; InvalidArgument
    without FlashInfer, without a paged CUDA cache, or with ``graphs=True``).

    ``compile`` (True or a mapping of ``torch.compile`` keywords; see :data:`COMPILE_OPTIONS`)
    runs every forward through ``torch.compile(model, **options)`` (default: inductor,
    ``dynamic=True``). ``dynamic=True`` makes the step width symbolic (the inputs are the
    token ids, positions and logit rows; parameters stay static): one graph serves every
    width, mixed steps and decode buckets alike (width 1 specializes: a second graph; a
    replayed bucket, which keeps every logit row, another), so mixed steps of any width
    never hit dynamo's recompile limit. ``dynamic=False`` compiles a graph per width (static
    shapes per decode bucket, but mixed widths soon exceed the limit and run eagerly);
    ``dynamic=None`` is torch's guess (static first, symbolic after a change). Attention is the custom op
    ``cellcache::attention`` (:func:`cellcache.torch.attention_op`), so the compiled
    forward is one graph. On CUDA with graphs the compiled forward is what each decode
    bucket captures (warm-up, which compiles, then capture): this runner stays the one
    owner of CUDA graphs, so modes that capture graphs themselves (``"reduce-overhead"``,
    ``"max-autotune"``, ``triton.cudagraphs``) are refused on CUDA, with or without the
    runner's graphs (the op decides its kernel per step). Attach's probe runs eagerly.

    Example: one decode step of ``seqs`` (one token each), padded as the runner decides

    >>> runner = cellcache.hf.attach(model, cache)                              # doctest: +SKIP
    >>> cache.declare_step(seqs)                                                # doctest: +SKIP
    >>> n = len(seqs); pad_to, decode = runner.padding(True, n, n, n)           # doctest: +SKIP
    >>> step = cache.prepare_step(stream=runner.stream, pad_to=pad_to)          # doctest: +SKIP
    >>> logits = runner.forward(step, next_ids, decode=decode)                  # doctest: +SKIP
    >>> cache.commit_step()                                                     # doctest: +SKIP
    """

    def __init__(self, model: Any, cache: CellCache, adapter: ModelAdapter, *,
                 graphs: bool | None = None, buckets: list[int] | None = None,
                 compile: bool | Mapping[str, Any] = False, mixed_buckets: list[int] | None = None,
                 attention: str = "auto"):
        options = check_options(compile, attention)
        view = cct.TorchView(cache)
        config = getattr(model, "config", None)
        if config is None or not callable(model):
            raise InvalidArgument(f"model of type {type(model).__name__} is not a transformers model")
        cfg = cache.config
        mw = cfg.max_write
        paged_cuda = view.cuda and cfg.paged
        if cfg.mask_format == "none" and not paged_cuda:
            where = "the host backend" if not view.cuda else "a CUDA cache without the paged view"
            raise InvalidArgument(f"{where} attends over masks, and this cache has none "
                                  "(mask_format='none'): build it with mask_format='bool' or 'bits' "
                                  "(cache_config(model) does)")
        if graphs is not None and not isinstance(graphs, bool):
            raise InvalidArgument(f"graphs of type {type(graphs).__name__} is not a bool or None")
        if attention == "flashinfer":
            if not paged_cuda:
                raise InvalidArgument("attention='flashinfer' needs a CUDA cache built with paged=True")
            if not cct.have_flashinfer():
                raise InvalidArgument("attention='flashinfer': FlashInfer is not installed "
                                      "(pip install flashinfer-python)")
            if graphs:
                raise InvalidArgument("attention='flashinfer' plans each step on the host and cannot "
                                      "be replayed from a graph: pass graphs=False (or None)")
            graphs = False
        paths = adapter.attention_paths(cfg) if paged_cuda else []
        # FlashInfer and SDPA fallbacks plan on the host or read the pools' row count, so
        # decode graphs are only for layers cellcache's or the tensor-core kernels take
        unsafe = [f"layer {i}: {p}" for i, p in enumerate(paths) if p not in ("tc", "paged")]
        graphs_enabled = (paged_cuda and not unsafe) if graphs is None else graphs
        if graphs_enabled and not paged_cuda:
            raise InvalidArgument("graph replay needs a CUDA cache built with paged=True")
        if graphs_enabled and unsafe:
            raise InvalidArgument(f"graph replay needs every layer on cellcache's or the tensor-core "
                                  f"kernels; {', '.join(unsafe[:4])} (its shape falls back): "
                                  "pass graphs=False")
        if options is not None and view.cuda and (
                options.get("mode") in _GRAPH_MODES
                or (options.get("options") or {}).get("triton.cudagraphs")):
            # inductor's own graphs would replay cellcache::attention without running it:
            # its per-step choices (kernel, decode or prefill variant) come from the step
            raise InvalidArgument(f"compile mode {options.get('mode')!r} with options "
                                  f"{options.get('options')!r} captures CUDA graphs itself, which "
                                  "cellcache's attention op cannot be replayed by; this runner "
                                  "captures the decode graphs (of the compiled forward): use mode "
                                  "'default' or 'max-autotune-no-cudagraphs'")
        chosen = default_buckets(mw, 512) if buckets is None else check_buckets(buckets, mw)
        if mixed_buckets is None:
            mixed = default_mixed_buckets(mw)
        elif isinstance(mixed_buckets, (list, tuple)) and len(mixed_buckets) == 0:
            mixed = []
        else:
            mixed = check_buckets(mixed_buckets, mw)
        self.model, self.cache, self.view, self.adapter = model, cache, view, adapter
        if options is not None:           # a symbolic width: one graph for every width
            options = {"dynamic": True, **options}
        #: The torch.compile options the forwards run under, or None (eager).
        self.compile = options
        # what _run calls: the model, or its compiled wrapper (attach's probe runs the model)
        self._forward = model if options is None else torch.compile(model, **options)
        self.device = view.device
        self.cuda = view.cuda
        self.graphs_enabled = graphs_enabled
        #: The attention backend every layer runs: "auto" (cellcache's kernels, the choice
        #: per shape) or "flashinfer" (FlashInfer's paged kernels over the same view, eager).
        self.attention = attention
        self.buckets = chosen
        #: Token-count buckets of the mixed-step graphs (see the class).
        self.mixed_buckets = mixed
        #: The most logit rows a mixed-step graph gives (its fixed index buffer's length: the
        #: largest decode bucket; a step with more logit rows runs eagerly).
        self.logit_cap = min(mw, chosen[-1])
        self._out: torch.Tensor | None = None          # the graphs' float32 logits, shared
        self._greedy: torch.Tensor | None = None       # and the argmax of each of their rows
        self._replayed_greedy: Any = None              # the last replayed graph's part of it
        # whether the graphs write their float32 logits (an int32 the graphs' logits_out
        # reads when it runs; forward(logits=False) clears it in stream order) and the
        # value last queued into it
        self._write: torch.Tensor | None = None
        self._writing = True
        # forward's views of a decode graph's first rows: (its logits, the logits' first
        # rows, its greedy ids' first rows) by (id of its logits, width) (_first_rows)
        self._row_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._handed: tuple[torch.Tensor, int] | None = None   # that view and its width, as
        #                                                          the last forward gave it
        #: The greedy ids (argmax, on the device) of the last forward's logits, row for row,
        #: when the forward was a graph replay that returned a plain slice of the graph's
        #: output (the graph computes them: no launch after it); None otherwise. Valid
        #: until the next replay, as the logits are.
        self.greedy: torch.Tensor | None = None
        # input_ids[0, :_fed_rows] holds the last decode graph's greedy ids (it writes them
        # there for the next step); 0 once anything else writes input_ids
        self._fed_rows = 0
        self._mixed: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._mixed_pool: Any = None
        self._rows_dev: torch.Tensor | None = None     # the mixed graphs' logit rows (device)
        self._rows_host: torch.Tensor | None = None    # and their pinned staging, event
        self._rows_staged: Any = None
        self.vocab = adapter.vocab()
        self.input_ids = torch.zeros((1, mw), dtype=torch.long, device=self.device)
        self._staging: torch.Tensor | None = None     # pinned upload buffer (CUDA) and its event
        self._staged: Any = None
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        # each bucket's graph without the shared-prefix pass, for steps whose rows cannot
        # group (cct.may_group); the same tuple where the two would launch the same kernels
        self._flat: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        # each bucket's graph without the shared-prefix pass and without the merge, for steps
        # whose rows cannot group and that have at least the bucket's live rows (kept where
        # 0 < live rows <= bucket), captured at the first such step (_capture_lean)
        self._lean_rows: dict[int, int] = {}
        self._lean: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._graph_generation = view.generation
        self.replays = 0
        #: Of :attr:`replays`, the decode steps replayed without the shared-prefix pass
        #: (rows that cannot group: :attr:`flat_graphs`, :attr:`lean_graphs`).
        self.flat_replays = 0
        #: Of :attr:`flat_replays`, those also without the merge (:attr:`lean_graphs`).
        self.lean_replays = 0
        self.eager = 0
        #: Whether the last forward replayed a graph.
        self.replayed = False
        #: The stream the runner's steps run on (None on the host) and its handle.
        self.stream = torch.cuda.current_stream(self.device) if self.cuda else None
        self.stream_handle = None if self.stream is None else int(self.stream.cuda_stream)
        # pinned row indexes of gathered feeds (a feed has at most max_seqs rows), four used
        # in turn, and their uploads' events; made now, on CUDA: a pinned allocation is a
        # driver call, and the first gathered feeds come in the middle of serving (where
        # rows start ending)
        self._fed_turn = 0
        self._fed_host: list[torch.Tensor] = []
        self._fed_done: list[Any] = []
        if self.cuda:
            n = max(1024, cache.max_seqs)
            self._fed_host = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(4)]
            self._fed_done = [torch.cuda.Event() for _ in range(4)]

    @property
    def mixed_graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The captured mixed-step graphs by token bucket (a copy, as :attr:`graphs`)."""
        return dict(self._mixed)

    def mixed_bucket(self, width: int, logit_rows: int = 1) -> int | None:
        """The mixed-step bucket a step of ``width`` tokens with ``logit_rows`` rows to sample
        is padded to, or None (it runs eagerly, unpadded): on CUDA with graphs, the smallest
        of :attr:`mixed_buckets` holding it, when its graph gives that many logit rows."""
        if not self.graphs_enabled:
            return None
        bucket = bucket_for(width, self.mixed_buckets)
        if bucket is None or logit_rows > min(bucket, self.logit_cap):
            return None
        return bucket

    @property
    def graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The captured decode graphs by bucket: (``torch.cuda.CUDAGraph``, its logits
        tensor, its greedy ids tensor), each with the shared-prefix pass (it replays any
        step). A copy: dropping or adding entries changes nothing in the runner. A replay
        writes the logits tensor only while :meth:`write_logits` is on (the last forward's
        setting)."""
        return dict(self._graphs)

    @property
    def flat_graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The decode graphs without the shared-prefix pass, by bucket (a copy, as
        :attr:`graphs`): a step whose rows cannot group (:func:`cellcache.torch.may_group`)
        replays its bucket's from here, unless it has the runs to replay
        :attr:`lean_graphs`' instead. Where a bucket's two would launch the same kernels
        (grouping off, a one-row bucket, layers off the tensor-core path) both hold the same
        entry."""
        return dict(self._flat)

    @property
    def lean_graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The decode graphs without the shared-prefix pass and without the tensor-core
        merge, by bucket (a copy, as :attr:`graphs`): a step whose rows cannot group and that
        has enough runs that none can be split along kv
        (:meth:`cellcache.cuda.tc.TensorCoreAttention.unsplit_rows`, the most any layer
        needs) replays its bucket's from here, captured at the first such step. A bucket
        whose other graphs leave the merge out already (the choice never splits), or whose
        steps never have enough rows, has none."""
        return dict(self._lean)

    def drop_graphs(self) -> None:
        """Lets go of every captured graph (and the memory pool it holds): they are captured
        again at first use (the pools or the weights they read moved: a copy growth,
        ``Generator.sleep(2)``). The mixed graphs' shared memory pool goes with the last of
        them: the next capture opens a new one (PyTorch refuses a pool whose graphs are gone)."""
        self._graphs.clear()
        self._flat.clear()
        self._lean.clear()
        self._lean_rows.clear()
        self._mixed.clear()
        self._mixed_pool = None

    # -- the model's attention setting -------------------------------------------------------
    def reattach(self) -> None:
        """Switches the model (back) to cellcache's attention, checked by one probe forward.

        A refusal (InvalidArgument: a layer that does not call cellcache's attention, or
        calls it with something it does not compute) restores the model's attention
        setting exactly as it was.
        """
        self.adapter.attach(self.view)

    # -- checks ----------------------------------------------------------------------------------
    def _token_ids(self, tokens: Any, width: int) -> np.ndarray:
        arr = _int_array(tokens, "tokens")
        if arr.size != width:
            raise InvalidArgument(f"{arr.size} tokens for a step of width {width}: give one token "
                                  "per real row")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab:
            raise InvalidArgument(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                                  f"[0, {self.vocab})")
        return arr

    @staticmethod
    def _logit_rows(logit_rows: Any, width: int) -> np.ndarray:
        if logit_rows is None:
            return np.arange(width)
        arr = _int_array(logit_rows, "logit_rows")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= width):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise InvalidArgument(f"logit row {bad} is outside the step's real rows [0, {width})")
        return arr

    # -- forwards -----------------------------------------------------------------------------------
    def bucket(self, width: int) -> int | None:
        """The smallest bucket that holds ``width`` rows (None when none does)."""
        return bucket_for(width, self.buckets)

    def padding(self, decode_only: bool, rows: int, tokens: int, logit_rows: int
                ) -> tuple[int | None, bool]:
        """How a step runs: the width to prepare it at (``prepare_step(pad_to=...)``; None:
        unpadded, eagerly) and the ``decode`` to :meth:`forward` it with. ``decode_only``:
        every one of its ``rows`` sequences feeds its next token; ``tokens`` rows in all,
        ``logit_rows`` of them sampled. With graphs on, a decode step at a decode bucket
        replays that bucket's graph; any other step is padded to a mixed bucket
        (:meth:`mixed_bucket`) when one holds it."""
        if not self.graphs_enabled:
            return None, False
        if decode_only:
            pad_to = self.bucket(rows)
            if pad_to is not None:
                return pad_to, True
        return self.mixed_bucket(tokens, logit_rows), False

    def _positions(self, step: Step) -> torch.Tensor:
        return self.view.positions[:step.pad_to][None]

    def _run(self, step: Step, backend: str, rows: torch.Tensor | None) -> torch.Tensor:
        return self.adapter.run(self._forward, self.view, step, backend,
                                self.input_ids[:, :step.pad_to], self._positions(step), rows)

    def forward(self, step: Step, tokens: Any = None, logit_rows: Any = None, decode: bool = False, *,
                device_tokens: torch.Tensor | None = None, logits: bool = True) -> torch.Tensor:
        """Runs the forward of ``step`` on ``tokens`` (one per real row); returns float32
        logits ``[len(logit_rows), vocab]`` (all real rows when None).

        ``step`` must be the cache's prepared step (InvalidState otherwise); ``tokens``
        exactly ``step.width`` ids in ``[0, vocab)``; ``logit_rows`` ids in
        ``[0, step.width)``; both 1-D sequences (or arrays, tensors) of ints. Every check
        runs before anything is written (InvalidArgument / InvalidState).

        ``device_tokens`` instead of ``tokens``: a 1-D integer tensor of ``step.width`` ids
        already on the runner's device (the previous step's sampled ids, gathered: the
        asynchronous generator feeds a step before its ids reach the host). It is copied
        into the input on the device's current stream without a host sync, so its values
        are not checked: they must be ids the model's own sampling drew. Both given:
        ``device_tokens`` are the first rows' ids (fewer than ``step.width``), ``tokens``
        the rest.

        On CUDA the host ``tokens`` go up through a pinned buffer without blocking the host.

        ``decode`` says every row is its sequence's next token (one token per sequence);
        then, on CUDA with graphs on, the step is replayed from a graph of its padded width.
        A replayed step's logits (decode or mixed) are a view of the float32 buffer every
        graph of this runner writes: valid until the next replayed forward, of any width (the
        step's sampling reads them before, in stream order); ``clone()`` them to keep them.

        ``logits=False``: the caller reads only :attr:`greedy` (the draws of greedy rows), so
        a replayed step leaves the float32 logits unwritten (the graph reads the model's
        logits once for their argmax: at 256 rows of a 152K vocabulary that is 156 MB not
        written a step); the tensor returned then holds whatever the buffer held. An eager
        step writes them either way.
        """
        if not isinstance(step, Step):
            raise InvalidArgument(f"step of type {type(step).__name__} is not a Step")
        if step is not self.cache.prepared_step:
            raise InvalidState("step is not this cache's prepared step (a committed step, an older "
                               "one or another cache's): pass the Step that prepare_step() just returned")
        self.adapter.check()
        T, width = step.pad_to, step.width
        handed = self._handed
        if device_tokens is not None:
            # the greedy ids the last replay handed out (self.greedy), fed back whole: known
            # to be right, so the checks below are skipped on the steady decode path
            mine = tokens is None and handed is not None and device_tokens is handed[0] \
                and handed[1] == width
            fits = isinstance(device_tokens, torch.Tensor) and (
                device_tokens.numel() == width if tokens is None else 0 < device_tokens.numel() < width)
            if not mine and (not fits or device_tokens.ndim != 1 \
                    or device_tokens.is_floating_point() or device_tokens.dtype == torch.bool \
                    or device_tokens.device != self.device):
                shown = (f"a {tuple(device_tokens.shape)} {device_tokens.dtype} tensor on "
                         f"{device_tokens.device}" if isinstance(device_tokens, torch.Tensor)
                         else f"of type {type(device_tokens).__name__}")
                want = f"{width} ids" if tokens is None else \
                    f"the first 1 to {width - 1} of the step's {width} ids (tokens the rest)"
                raise InvalidArgument(f"device_tokens is {shown}; give a 1-D integer tensor of "
                                      f"{want} on {self.device}")
            ids_np = None if tokens is None else self._token_ids(tokens, width - device_tokens.numel())
        elif tokens is None:
            raise InvalidArgument("give the step's tokens (or device_tokens)")
        else:
            ids_np = self._token_ids(tokens, width)
        rows = None if logit_rows is None else self._logit_rows(logit_rows, width)
        if not isinstance(decode, (bool, np.bool_)):
            raise InvalidArgument(f"decode of type {type(decode).__name__} is not a bool")
        if not isinstance(logits, (bool, np.bool_)):
            raise InvalidArgument(f"logits of type {type(logits).__name__} is not a bool")
        if self.view.stale():                 # a copy growth moved the pools
            self.view.refresh()
        if self._graph_generation != self.view.generation:
            self.drop_graphs()                # they read the old pools: recaptured on next use
            self._graph_generation = self.view.generation
        self.greedy = None
        self._handed = None
        self.replayed = False
        if ids_np is not None and device_tokens is not None:   # the first rows' ids on the device
            n = device_tokens.numel()
            self.input_ids[0, :n].copy_(device_tokens, non_blocking=True)
            self._upload(ids_np, n)
            self._fed_rows = 0
        elif device_tokens is not None:
            # the previous decode graph's own greedy ids: already in input_ids (it put them there)
            greedy = self._greedy
            if not (greedy is not None and width <= self._fed_rows
                    and (mine or (device_tokens.data_ptr() == greedy.data_ptr()
                                  and device_tokens.dtype == greedy.dtype
                                  and device_tokens.stride(0) == 1))):
                self.input_ids[0, :width].copy_(device_tokens, non_blocking=True)
                self._fed_rows = 0
        elif ids_np is not None:
            self._upload(ids_np)
            self._fed_rows = 0
        # rows [width, T) are padding: they keep ids of earlier steps (always ids in [0, vocab):
        # the buffer starts zeroed and only checked or drawn ids are written), their outputs dropped
        every = rows is None or (rows.size == width and (
            width == 0 or (rows[0] == 0 and rows[-1] == width - 1 and bool((np.diff(rows) == 1).all()))))
        # (8-bit K/V: eager until every layer's scales are set, by a first write outside a graph)
        graphs = self.graphs_enabled and self.view.kv_scales_ready()
        if graphs and decode and T in self.buckets:
            # (greedy is handed out for every real row alone: other rows read the logits)
            self.write_logits(logits or not every)
            out = self._replay(step)          # (the capture, on first use, in inference mode)
            self.replays += 1
            self.replayed = True
            self._fed_rows = T
            if every:                         # every real row: a slice, no index upload
                out, self.greedy = self._first_rows(out, width)
                self._handed = (self.greedy, width)
                return out
            assert rows is not None
            return out[self._index(rows)]
        with torch.inference_mode():
            n_rows = width if rows is None else rows.size
            if graphs and not decode and T in self.mixed_buckets \
                    and n_rows <= min(T, self.logit_cap):
                self.write_logits(logits)
                out = self._replay_mixed(step, rows, n_rows)
                self.replays += 1
                self.replayed = True
                self._fed_rows = 0            # its greedy ids overwrote the decode graph's
                self.greedy = self._replayed_greedy[:n_rows]
                return out[:n_rows]
            self.eager += 1
            # "auto": on CUDA with the paged view, the path choose_path gives each layer's
            # shape (cellcache's decode kernel for decode steps, its prefill kernel with the
            # device-built work list for mixed ones, or the tensor-core kernels)
            if rows is None:
                if self.compile is None:      # every row's logits, the padding rows' dropped
                    return self._run(step, self.attention, None)[:width].float()
                rows = np.arange(width)       # compiled: rows as a tensor, as every eager step
            return self._run(step, self.attention, self._index(rows)).float()

    def _upload(self, ids: np.ndarray, at: int = 0) -> None:
        """Host ids into ``input_ids`` from row ``at`` on: on CUDA through a pinned staging
        buffer, without blocking the host (the buffer is reused once the previous upload has
        run)."""
        n = ids.size
        if not self.cuda:
            self.input_ids[0, at:at + n].copy_(torch.from_numpy(ids))
            return
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, self.input_ids.shape[1]), dtype=torch.long, pin_memory=True)
            self._staged = torch.cuda.Event()
        else:
            self._staged.synchronize()        # the previous upload has left the buffer
        self._staging[:n].numpy()[:] = ids
        self.input_ids[0, at:at + n].copy_(self._staging[:n], non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.device))

    def _index(self, rows: np.ndarray) -> torch.Tensor:
        """Logit rows as a tensor on the device."""
        t = torch.from_numpy(rows)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _replay_mixed(self, step: Step, rows: np.ndarray | None, n: int) -> torch.Tensor:
        """Replays (capturing on first use) the mixed-step graph of ``step.pad_to`` tokens;
        its logits (``min(pad_to, logit_cap)`` rows) are for ``rows`` (None: rows 0..n-1),
        written into the graphs' index buffer (the rest point at row 0). The capture runs
        the prefill kernels whatever the captured step looks like (:data:`cct.MIXED_CAPTURE`):
        the graph replays any mix of rows."""
        T = step.pad_to
        cap = min(T, self.logit_cap)
        if self._rows_dev is None:
            self._rows_dev = torch.zeros(self.logit_cap, dtype=torch.long, device=self.device)
            self._rows_host = torch.zeros(self.logit_cap, dtype=torch.long, pin_memory=True)
            self._rows_staged = torch.cuda.Event()
        else:
            self._rows_staged.synchronize()   # the previous upload has left the buffer
        assert self._rows_host is not None
        host = self._rows_host.numpy()
        host[:n] = np.arange(n) if rows is None else rows
        host[n:cap] = 0
        self._rows_dev[:cap].copy_(self._rows_host[:cap], non_blocking=True)
        self._rows_staged.record(torch.cuda.current_stream(self.device))
        if T not in self._mixed:
            if self._mixed_pool is None:
                self._mixed_pool = torch.cuda.graph_pool_handle()
            token = cct.MIXED_CAPTURE.set(True)
            try:
                # one memory pool for every mixed graph: they replay one at a time, in stream order
                self._mixed[T] = self._capture(step, self._rows_dev[:cap], cap, self._mixed_pool,
                                               feed=False)
            finally:
                cct.MIXED_CAPTURE.reset(token)
        graph, logits, greedy = self._mixed[T]
        graph.replay()
        self._replayed_greedy = greedy
        return logits

    def write_logits(self, on: bool = True) -> None:
        """Whether graph replays write their float32 logits from now on (their greedy ids are
        written either way): the graphs' flag, set on the current stream in stream order
        when it changes (before the first capture there is none: they write). :meth:`forward`
        sets it for each replayed step; a caller replaying :attr:`graphs` itself sets it
        first. InvalidArgument for a value that is not a bool."""
        if not isinstance(on, (bool, np.bool_)):
            raise InvalidArgument(f"on of type {type(on).__name__} is not a bool")
        if self._write is not None and self._writing != on:
            with torch.inference_mode():      # (made in a capture: an inference tensor)
                self._write.fill_(int(on))
            self._writing = bool(on)

    def _shared_out(self, rows: int, width: int) -> torch.Tensor:
        """The one float32 logits buffer every graph writes its output into (graphs replay
        one at a time in stream order, and a step's logits are read before the next replay):
        ``[max(logit_cap, largest bucket), width]``, made before the first capture (``width``:
        the logits' width, from the warm-up forward), with the int64 buffer of their rows'
        greedy ids beside it."""
        n = max(self.logit_cap, self.buckets[-1], rows)
        if self._out is None or self._out.shape[1] != width or self._out.shape[0] < rows:
            self._out = torch.empty((n, width), dtype=torch.float32, device=self.device)
            self._greedy = torch.zeros(n, dtype=torch.long, device=self.device)
        if self._write is None:
            self._write = torch.ones(1, dtype=torch.int32, device=self.device)
            self._writing = True
        return self._out

    def _capture(self, step: Step, index: torch.Tensor | None, rows: int,
                 pool: Any = None, feed: bool = True) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """A graph of ``step``'s forward (logits of ``index``, None: every row) writing its
        ``rows`` float32 logits into the shared buffer and their greedy ids (argmax) into
        the ids buffer, after one eager warm-up on a side stream (allocations, kernel
        loads); returns (graph, its logits view, its greedy ids view). ``feed`` (decode graphs, every row's
        logits): the graph also copies the greedy ids into ``input_ids``, where the next
        decode step of the same rows, greedy, finds its tokens without a launch."""
        with torch.inference_mode():
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream):
                    warm = self._run(step, "auto", index)
            finally:
                torch.cuda.current_stream(self.device).wait_stream(stream)
            out = self._shared_out(rows, warm.shape[-1])
            greedy = self._greedy
            assert greedy is not None
            # once outside the capture: its first call loads the kernel's module (a module
            # load is no stream work and has no place inside a capture)
            logits_out(warm, out[:rows], greedy[:rows], self._write)
            del warm
            graph = torch.cuda.CUDAGraph()
            # float32 logits and their greedy ids out of the graph: no launch after it. Both
            # from one read of the model's own logits (cuda/fused.cu logits_out; the cast is
            # exact, so the ids are those of the float32 copy)
            with torch.cuda.graph(graph, pool=pool):
                logits = out[:rows]
                model_logits = self._run(step, "auto", index)
                logits_out(model_logits, logits, greedy[:rows], self._write)
                del model_logits
                if feed:                      # ids in [0, vocab): pad rows' are harmless too
                    self.input_ids[0, :rows].copy_(greedy[:rows])
        return graph, logits, greedy[:rows]

    def _first_rows(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``width`` rows of a replayed decode graph's ``logits`` and of its greedy
        ids: the same two views each time for one graph and width (no slicing on the steady
        decode path)."""
        key = (id(logits), width)
        views = self._row_views.get(key)
        if views is None:               # (an entry holds its logits: their id is not reused)
            if len(self._row_views) >= 1024:
                self._row_views.clear()
            views = self._row_views[key] = (logits, logits[:width], self._replayed_greedy[:width])
        return views[1], views[2]

    def _capture_decode(self, step: Step, T: int) -> None:
        """Bucket ``T``'s decode graph, captured from ``step`` with the shared-prefix pass
        (it replays any step), then, where that capture launched the pass, once more without
        it into the same memory pool (the two never run at once, and their outputs live
        outside the pool): a step whose rows cannot group replays that one (no empty pass in
        every layer). The first capture's tensor-core layers tell how many runs a step needs
        so that none can be split (:class:`cellcache.torch.Grouping`'s ``need``); where that
        is more than 0 (at 0 the second graph leaves the merge out itself) and at most
        ``T``, the first step with that many runs whose rows cannot group captures a third
        graph, without the merge (:meth:`_capture_lean`)."""
        grouping = cct.Grouping(True)
        token = cct.GROUPING.set(grouping)
        try:
            graphs = self._capture(step, None, T)
        finally:
            cct.GROUPING.reset(token)
        flat = graphs
        if grouping.used:
            token = cct.GROUPING.set(cct.Grouping(False))
            try:
                flat = self._capture(step, None, T, pool=graphs[0].pool())
            finally:
                cct.GROUPING.reset(token)
        self._graphs[T], self._flat[T] = graphs, flat
        if grouping.need is not None and 0 < grouping.need <= T:
            self._lean_rows[T] = grouping.need

    def _capture_lean(self, step: Step, T: int, live: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Bucket ``T``'s graph without the shared-prefix pass and without the merge, captured
        from ``step`` into the pool of the bucket's first graph under the promise of ``live``
        runs with a query in every step it replays (``step`` must keep it too: the capture's
        warm-up runs it eagerly under the same promise)."""
        token = cct.GROUPING.set(cct.Grouping(False, live_rows=live))
        try:
            lean = self._lean[T] = self._capture(step, None, T, pool=self._graphs[T][0].pool())
        finally:
            cct.GROUPING.reset(token)
        return lean

    def _replay(self, step: Step) -> torch.Tensor:
        """Replays bucket ``step.pad_to``'s decode graph, captured at its first step: the one
        with the shared-prefix pass, or, where the step's rows cannot group
        (:func:`cellcache.torch.may_group`), the one without it, or the one without the merge
        too where the step has the bucket's live rows (captured at the first such step)."""
        T = step.pad_to
        if T not in self._graphs:
            self._capture_decode(step, T)
        graphs = self._graphs[T]
        flat = self._flat[T]
        live = self._lean_rows.get(T, 0)      # 0: the bucket has no graph without the merge
        if live or flat is not graphs:
            # where the first two graphs are one (its capture launched no shared-prefix
            # pass), a step's rows need not be asked whether they group
            alone = flat is graphs or not cct.may_group(self.view, step)
            if alone and live and step.n_runs >= live:
                lean = self._lean.get(T)
                graphs = lean if lean is not None else self._capture_lean(step, T, live)
                self.lean_replays += 1
                self.flat_replays += 1
            elif alone and flat is not graphs:
                graphs = flat
                self.flat_replays += 1
        graph, logits, greedy = graphs
        graph.replay()
        self._replayed_greedy = greedy
        return logits

    def synchronize(self) -> None:
        """Waits for everything queued on the runner's device (nothing on the host)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- feeds from the device ---------------------------------------------------------------
    def gather(self, ids: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """``ids[slots]`` on ``ids``' device (``slots``: int64 row numbers, at most
        ``max(1024, max_seqs)``): a step's tokens picked from the previous step's draws
        without a host sync. A prefix ``0..n-1`` is a slice; otherwise the index goes up
        through pinned buffers kept for it, used in turn: one is written again only once
        its upload has run, which with at most two steps queued it has (no wait)."""
        n = slots.size
        if n and slots[0] == 0 and slots[-1] == n - 1 and (n == 1 or bool((np.diff(slots) == 1).all())):
            return ids[:n]                            # the rows left out were the last ones
        if ids.device.type != "cuda":
            return ids.index_select(0, torch.from_numpy(slots))
        self._fed_turn = turn = (self._fed_turn + 1) % len(self._fed_host)
        host, done = self._fed_host[turn], self._fed_done[turn]
        done.synchronize()
        host.numpy()[:n] = slots
        index = host[:n].to(ids.device, non_blocking=True)
        done.record(self.stream)
        return ids.index_select(0, index)

    def _warm_feed(self) -> None:
        """Runs :meth:`gather`'s ``index_select`` once with up to 16 indices and once with
        more (torch launches a different kernel for each): a torch kernel's first launch
        loads its code, which would otherwise happen in the middle of serving, in the step
        where the first rows end."""
        ids = torch.zeros(len(self._fed_host[0]), dtype=torch.int64, device=self.device)
        for n in (1, len(ids)):
            ids.index_select(0, torch.zeros(n, dtype=torch.int64, device=self.device))
        torch.cuda.current_stream(self.device).synchronize()

    # -- warm-up: the graphs captured before serving -------------------------------------------
    def warmup_buckets(self, widths: Sequence[int] | None, mixed: Sequence[int] | None,
                       rows: int) -> list[tuple[str, int]]:
        """The captures :meth:`warmup` makes, in order: ``("decode" | "mixed", bucket)``.
        ``widths``: decode buckets (default: every bucket up to the one holding ``rows``, the
        most sequences a decode step can have); ``mixed``: mixed buckets (default: all;
        ``[]``: none). InvalidArgument for a width that is not one of the buckets. The
        steps that need the most cells come first: a growth that moves the pools (copy
        growth) drops the graphs, so it happens before any is captured."""
        limit = bucket_for(rows, self.buckets) or self.buckets[-1]
        chosen = [b for b in self.buckets if b <= limit] if widths is None \
            else _bucket_list(widths, self.buckets, "widths")
        mixed_chosen = list(self.mixed_buckets) if mixed is None \
            else _bucket_list(mixed, self.mixed_buckets, "mixed")
        return [("mixed", w) for w in reversed(mixed_chosen)] + [("decode", w) for w in reversed(chosen)]

    def warmup(self, cache: Any, todo: list[tuple[str, int]]) -> dict[str, list[int]]:
        """Captures the graphs of ``todo`` (:meth:`warmup_buckets`) not captured yet, each
        by one real step of fresh sequences made and freed through ``cache`` (this runner's
        cache, or a :class:`cellcache.tp.TPCache` over it, whose verbs every rank agrees);
        on CUDA it first launches :meth:`gather`'s kernels once. Returns the buckets
        captured now, ``{"decode": [...], "mixed": [...]}`` (both empty when the runner
        replays no graphs). InvalidState, nothing changed, while the cache has a step
        declared or prepared; OutOfMemory (that bucket not captured, its sequences freed)
        when the cache cannot hold a step (StepTooLarge when a prompt-chunk bucket exceeds
        the paged view's ``max_kv``). With ``compile``, once it has captured a graph it
        shuts inductor's idle compile workers down (:func:`release_compile_workers`)."""
        if cache.prepared_step is not None or self.cache.table.declared_width:
            raise InvalidState("warmup() while the cache has a step declared or prepared "
                               "(another user's): call it when no step is pending")
        done: dict[str, list[int]] = {"decode": [], "mixed": []}
        if self._fed_host:                    # (CUDA, graphs or not)
            self._warm_feed()
        if not (self.cuda and self.graphs_enabled):
            return done
        # 8-bit K/V: the warm-up's dummy tokens set the scales its captures need; a cache
        # whose scales were unset gets them unset again, for its first real K/V to set
        fresh = self.view.config.kv8 and not any(self.view.kv_scales_set(i)
                                                 for i in range(len(self.view.config.layers)))
        with cache.lock:
            try:
                for kind, width in todo:
                    have = self._graphs if kind == "decode" else self._mixed
                    if width in have and not self.view.stale():
                        continue
                    self._capture_bucket(cache, width, kind == "decode")
                    done[kind].append(width)
            finally:
                if fresh and self.cache.free_cells == self.cache.config.capacity:
                    self.view.reset_kv_scales()
        if self.compile is not None and (done["decode"] or done["mixed"]):
            release_compile_workers()
        return {k: sorted(v) for k, v in done.items()}

    def _capture_bucket(self, cache: Any, width: int, decode: bool) -> None:
        """One step padded to bucket ``width``, whose forward captures (and replays) the
        bucket's graph: a decode step of up to ``width`` fresh one-token sequences, or a
        prompt chunk of up to ``width`` tokens of one fresh sequence; freed again."""
        room = cache.free_cells
        n = min(width, cache.max_seqs - len(cache.live_seqs()), room) if decode else min(width, room)
        sids: list[int] = []
        try:
            for _ in range(n if decode else min(n, 1)):
                sid = cache.seq_new()
                if sid is None:
                    break
                sids.append(sid)
            feed = sids if decode else sids * n
            if not feed or not cache.declare_step(feed):
                raise OutOfMemory(f"warmup: the cache has no room for a step at bucket {width} "
                                  f"({room} free cells, {len(sids)} sequence ids)")
            step = cache.prepare_step(stream=self.stream, pad_to=width)
            try:
                self.forward(step, [0] * len(feed), None if decode else [len(feed) - 1], decode=decode)
            finally:                              # committed even when it raised (as a step's
                cache.commit_step()               # rollback does): its writes may be queued
        finally:
            for sid in sids:
                cache.seq_rm(sid)
