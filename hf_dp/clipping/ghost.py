"""Ghost clipping ("book-keeping"): per-example clipped gradient sums without materialising per-example gradients.

Opacus' hooks materialise every example's gradient (``[B, *p.shape]`` per parameter) and Opacus'
own ghost mode needs a *second* backward pass with the clip factors as loss weights. Here one
backward pass captures, for every trainable layer, what its per-example gradient is made of (for a linear
layer: its input activations ``a`` and output gradients ``g``); then each layer type computes

* the per-example squared norms from those records directly ("ghost norms", e.g. ⟨a aᵀ, g gᵀ⟩ for a linear layer
  on a sequence), and
* with the clip factors c_i = min(1, C/(‖∇ℓ_i‖·(1 + 1e-5) + 1e-6)) (Opacus' formula with a small relative
  margin, see :func:`clip_factors`), the clipped sum — for a
  linear weight one matmul (c·g)ᵀa or gᵀ(c·a), the same cost as the ordinary weight gradient, which the layer's custom
  autograd function does *not* compute during backward.

Which layer types, and how: the registry (:mod:`hf_dp.clipping.registry`), one file per type —
:mod:`hf_dp.clipping.linear` (``nn.Linear``, transformers' ``Conv1D``; also the single-query factorisation of
the first-token-only last block and the optional materialisation, ``materialize_bytes``),
:mod:`hf_dp.clipping.layernorm`, :mod:`hf_dp.clipping.rmsnorm`, :mod:`hf_dp.clipping.embedding` (incl. broadcast
position ids, see :func:`hf_dp.clipping.hooks.install_batch_hooks`), and the tied input/output embedding pair
(:mod:`hf_dp.clipping.tied`). This module names no layer type. A layer called several times in one forward
(ALBERT's shared block) is handled by concatenating its calls along the token axis.

**Privacy units** (``units=``, issue 29): the rows of one unit are one "example". Each layer's records are
regrouped (:class:`~hf_dp.clipping.common.UnitIndex`) so that unit u's rows sit side by side along the token axis,
the slots of a unit with fewer rows zero-filled (zero activations and zero output gradients add nothing to any
layer's gradient); the layer types' ``terms`` then run unchanged and give ‖v_u‖² and Σ_u c_u v_u — the non-finite
re-check, the materialisation and the affine maps (once per unit) included. The single-query hint is dropped when a
unit has several rows. Two passes regroup the same way in pass 1 and weight row r by c_{units[r]} in pass 2.
``units=None`` takes exactly the code path of before.
:meth:`GhostClipper.clipped_sum` frees each layer's records as soon as its clipped sum exists.

**Norms are upper bounds.** Every layer type returns, in float64, an upper bound of the exact squared norm of the
gradient its float32 records define — never the float32 value itself, which can fall far short: the Gram form
Σ_{t,s}(a_t·a_s)(g_t·g_s) sums terms of both signs whose rounding is relative to S_i² = (Σ_t ‖a_t‖‖g_t‖)², not to the
result (one input repeated with output gradients of alternating sign cancels it to nothing), and the records carry
the loss scale s (undone once, at the end), so with s ≪ 1 their float32 squares may underflow. The Gram products are
summed in float32 over chunks of 512 features and in float64 across chunks and over the T×T entries; the worst-case
rounding of any summation order (γ_n = n·u/(1 − n·u), u = 2^-24) and an absolute term for underflow (n·2^-149 per
entry) are added (:func:`hf_dp.clipping.common.gram_bound`); per-example gradients formed in float32 (materialised
linear gradients, LayerNorm/RMSNorm weights, biases) get ‖fl(G_i)‖ (float64) + γ_{T+1}·S_i + the underflow term
(:func:`~hf_dp.clipping.common.summed_sq`). The float32 clipped sum over the micro-batch's N tokens rounds too, by
at most γ_{N+2}·Σ_i c_i S_i: each bound of ‖G_i‖ also gets γ_{N+2}·S_i (:func:`~hf_dp.clipping.common.sum_gamma`), so
c_i times (‖G_i‖ + the example's share of that rounding) is ≤ C as well. **Every count in these allowances is a
public constant of the run** (:class:`~hf_dp.clipping.common.TokenBounds`, issue 49), never the micro-batch's own:
T is the run's ``max_length`` (per call of the layer; a unit of k rows: k·``max_length``) and N its ``max_tokens``
(plus the micro-batches' additions), so each example's clip factor is a function of that example alone — with the
batch's own counts, one long row joining 256 copies of a short one lowered every copy's factor and moved the sum by
up to 5 C. A micro-batch above ``max_tokens`` must be split by the caller (DPTrainer does) and the layers raise
``ValueError`` for records beyond the bounds. For typical data S_i/‖G_i‖ is about √T, so ‖v_i‖ grows by about
T·γ_512 + √T·γ_{N+2}: 1–2 % for a row of the maximum length at N ≈ 10⁴ (measured on tiny GPT-2 / Llama rows of 160
tokens, tests/test_sensitivity.py; worst-case bounds: the actual rounding is far smaller), less for short rows. (Rules with a
per-sample affine map keep float32 cross terms ⟨G_i, o⟩; the margin of :func:`clip_factors` covers their rounding
only approximately.)

So the DP step costs about one forward, one backward and the ghost norms. The result is exactly
Σ_i c_i ∇ℓ_i as Opacus would compute it (tests compare against Opacus' per-sample gradients). Its memory:
every layer's input (which autograd keeps until that layer's backward anyway) and output gradient stay
alive until the clip factors are known, at the end of backward.

**Two passes** (``two_pass=True``, ``--clipping ghost_two_pass``) keep nothing: pass 1
(:meth:`GhostClipper.norms_pass`) is a backward of Σ_i ℓ_i towards the outputs of the lowest trainable
layers only (``torch.autograd.grad``, graph retained), so autograd computes input gradients but no
weight gradient; each layer's norm terms are computed by a hook on its output as soon as its output
gradient exists (a layer called several times: once all calls have theirs) and the records are dropped.
Pass 2 is an ordinary backward of Σ_i c_i ℓ_i (c detached) through the same graph — same dropout masks —
whose parameter gradients are exactly Σ_i c_i ∇ℓ_i (:meth:`GhostClipper.grads_after_backward` takes them
from ``.grad``). Cost: one more input-gradient backward plus the norms. Memory: no records, but pass 1
holds the whole graph while its transient input gradients exist (a non-private backward frees saved
tensors as it goes) — measured (full fine-tuning, benchmarks/RESULTS.md §1) 1.10× the non-private peak where
one pass needs 1.22× at B = 128, L = 32, but 1.11× where one pass needs 1.05× at B = 32, L = 128. Float32 (or float64) layers only: in reduced precision pass 2 would round the sum across examples, so
the bound would hold only up to that rounding (one pass sums in float32). The single-query factorisation
is not used there (pass 2 sums the exact gradients, so the norms must be those of the exact gradients).

Rules that map each example's gradient by a public per-coordinate affine map before clipping,
v_i = (g_i + o) ⊙ s (DP-SGD-L2: o = λθ; DP-MacAdam: o = −m̂, s = 1/b), are handled exactly (``affine=``):
‖v_i‖² expands into terms of the same records (each layer type's ``terms``), and
Σ_i c_i v_i = (Σ_i c_i g_i + (Σ_i c_i)·o) ⊙ s. Where ghost clipping cannot apply — a trainable layer type the
registry does not know, parameters shared between modules other than an embedding tied to an output
``nn.Linear`` — :class:`GhostClipper` raises ``ValueError`` and the Opacus hooks must be used.

Non-finite and overflowing examples: :mod:`hf_dp.clipping.checked` (each contributes a finite c_i v_i, ‖·‖ ≤ C).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn

from .checked import capped as _capped, checked_terms, work_dtype as _work_dtype
from .common import TokenBounds, Workspace, unit_index
from .copies import note_hooks
from .hooks import install_batch_hooks
from .registry import Layer, layer_type_for, recording


#: relative safety margin on ghost norms before computing clip factors (see GhostClipper.clipped_sum)
NORM_MARGIN = 1e-5


@contextmanager
def _no_autocast():
    """Norms and clipped sums in their own precision (float32/float64), also when called inside autocast, and with
    full-precision float32 matmuls (no TF32 or bf16 passes under ``--tf32`` / ``set_float32_matmul_precision``): the
    norms' rounding bounds assume float32's unit roundoff 2^-24."""
    precision = torch.get_float32_matmul_precision()
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast("cpu", enabled=False):
            if torch.cuda.is_available():
                with torch.autocast("cuda", enabled=False):
                    yield
            else:
                yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = cuda_tf32


class GhostClipper:
    """Attach to a model whose trainable parameters all live in supported layers.

    Usage per micro-batch: forward, ``loss.backward()``, then ``clipped_sum(max_grad_norm, loss_scale)``
    returns ``{param: Σ_i c_i ∇_param ℓ_i}`` and clears the records. ``per_example_norms(loss_scale)``
    gives ‖∇ℓ_i‖ (for tests and diagnostics). With ``two_pass=True``: forward, ``norms_pass(losses)``
    (‖v_i‖², no records kept), a backward of Σ_i c_i ℓ_i, ``grads_after_backward(c)`` — or
    ``two_pass_clipped_sum(losses, max_grad_norm)`` for all three.
    """

    @staticmethod
    def check_supported(model: nn.Module) -> list[tuple[nn.Module, object]]:
        """The (module, registered layer type) pairs to instrument (:func:`hf_dp.clipping.registry.layer_type_for`);
        ``ValueError`` if ghost clipping cannot apply.

        A parameter used by two modules is refused, except an ``nn.Embedding`` whose weight is also the weight of an
        ``nn.Linear`` (tied input/output embeddings, GPT-2's ``lm_head``, Llama with ``tie_word_embeddings``): the
        pair becomes one entry, (the embedding, :class:`~hf_dp.clipping.tied.TiedEmbeddingType`), whose norms
        include the cross term of the two uses (:mod:`hf_dp.clipping.tied`)."""
        from .tied import tie_of

        entries: dict[str, list] = {}  # name -> [module, layer type]
        users: dict[int, list] = {}  # id(param) -> [(name, module), ...]
        for name, m in model.named_modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                users.setdefault(id(p), []).append((name, m))
            ltype = layer_type_for(m)
            if ltype is None:
                raise ValueError(
                    f"ghost clipping does not support trainable layer {name} ({type(m).__name__}); "
                    "use --clipping hooks (Opacus per-sample gradients)"
                )
            ltype.check(m, name)
            entries[name] = [m, ltype]
        if not entries:
            raise ValueError("the model has no trainable parameter")
        for us in users.values():
            if len(us) > 1:  # ValueError unless an embedding tied to an output linear layer
                emb_name, head_name, ltype = tie_of(us)
                entries[emb_name][1] = ltype
                del entries[head_name]
        return [(m, ltype) for m, ltype in entries.values()]

    def __init__(self, model: nn.Module, materialize_bytes: int = 0, two_pass: bool = False, bounds: TokenBounds | None = None):
        self.model = model
        #: the public token bounds of every rounding allowance (:class:`~hf_dp.clipping.common.TokenBounds`; default:
        #: the model's maximum positions and 16 rows of them); DPTrainer sets the run's (``--dp_max_length``)
        self.bounds = bounds if bounds is not None else TokenBounds.for_model(model)
        self.two_pass = bool(two_pass)
        self.materialize_bytes = 0 if self.two_pass else int(materialize_bytes)
        self._phase: str | None = None  # two-pass: "norms" while norms_pass runs its backward
        self._roots: list = []  # two-pass: outputs of the lowest trainable layers of the current forward
        self._sq: torch.Tensor | None = None
        self._affine_now: dict = {}
        self._work = Workspace(bounds=self.bounds)  # two-pass: the Gram cache of pass 1
        self._zero_rows: torch.Tensor | None = None  # two-pass: examples whose output gradients pass 2 zeroes
        self._units = None  # two-pass: the UnitIndex of the norms pass in flight
        self.batch_size: int | None = None
        self.paused = False  # pause(): the batch hooks (hf_dp.clipping.hooks.install_batch_hooks) leave the model as it is
        self._handles: list = []  # hooks and forward patches, each with remove()
        self.layers = [Layer(m, ltype) for m, ltype in self.check_supported(model)]
        self._handles.extend(install_batch_hooks(model, self))
        if self.two_pass:  # a new forward starts a new graph: forget the last one's roots and call counts
            self._handles.append(model.register_forward_pre_hook(lambda _m, _a: self.clear()))
        for layer in self.layers:
            self._handles.extend(self._instrument_two_pass(layer) if self.two_pass else layer.type.instrument(layer))
        note_hooks(model, self._handles)  # a copy of the model is a plain model (hf_dp.clipping.copies)

    # ----- instrumentation (one pass: each layer type's own, see hf_dp.clipping.registry) ----------------
    def _instrument_two_pass(self, layer: Layer) -> list:
        """Every layer type keeps its own forward and backward; a forward hook notes the input and hooks
        the output's gradient, which only :meth:`norms_pass` consumes (pass 2 is an ordinary backward). An entry of
        several modules (a tied pair) gets a hook on each, its records tagged with the member's ``record_tags``."""
        tags = layer.type.record_tags or (None,) * len(layer.modules)

        def fwd_hook(module, args, out, _layer=layer, _tag=None):
            if not recording(module, _layer) or not torch.is_tensor(out) or not out.requires_grad:
                return
            if out.dtype not in (torch.float32, torch.float64):
                raise ValueError(
                    f"two-pass ghost clipping needs float32 layers ({type(module).__name__} returned {out.dtype}): pass 2 "
                    "would sum the clipped per-example gradients in reduced precision across examples; use one pass"
                )
            x = args[0]
            _layer.calls += 1
            if not (x.is_floating_point() and x.requires_grad):  # nothing trainable below: a root of pass 1
                self._roots.append(out)
            x = x.detach()
            out.register_hook(lambda g, _x=x: self._on_grad(_layer, _x, g, _tag))

        return [m.register_forward_hook(functools.partial(fwd_hook, _tag=tag)) for m, tag in zip(layer.modules, tags)]

    def _on_grad(self, layer: Layer, x: torch.Tensor, g: torch.Tensor, tag=None):
        if self._phase != "norms":  # pass 2: the output gradients of examples with c_i = 0 become exactly 0
            zero = self._zero_rows
            return None if zero is None else g.masked_fill(zero.view(-1, *([1] * (g.dim() - 1))), 0)
        # no single-query hint: pass 2 sums the exact gradients
        layer.records.append((x, g, None) if tag is None else (x, g, None, tag))
        if len(layer.records) == layer.calls:  # every call of the layer has its gradient: norms now, then drop
            self._work.bound_layer(layer.records, self._units)
            grouped = layer if self._units is None else self._grouped(layer, self._units)
            with _no_autocast():
                sq, _ = checked_terms(grouped, 1.0, self._affine_now, self._work, with_sum=False)
            self._sq = sq if self._sq is None else self._sq + sq
            layer.records.clear()
            del grouped
            layer.done = True

    def pause(self, paused: bool = True) -> None:
        """Pause (or resume) the instrumentation without removing it: while paused every instrumented module runs the
        forward it had before (its own, or another clipper's instrumentation, itself paused or not), records nothing
        for this clipper and gets autograd's weight gradients (:func:`hf_dp.clipping.registry.recording`), so the
        model can be trained or differentiated otherwise. ``DPTrainer`` keeps its clipper paused outside its
        ``training_step`` (:meth:`hf_dp.clipping.engines.ClippingEngine.active`)."""
        self.paused = bool(paused)
        for layer in self.layers:
            layer.state["paused"] = bool(paused)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.pause(True)  # a detached clipper records nothing (another clipper's patch may still lead to its own)
        self.clear()

    def clear(self) -> None:
        for layer in self.layers:
            layer.records.clear()
            layer.calls = 0
            layer.done = False
        self._roots = []
        self._sq = None
        self._work = Workspace(bounds=self.bounds)
        self._zero_rows = None

    # ----- privacy units ------------------------------------------------------------------------------------
    @staticmethod
    def _grouped(layer: Layer, idx) -> Layer:
        """A stand-in for ``layer`` whose records are regrouped by privacy unit (:class:`~hf_dp.clipping.common.UnitIndex`):
        each unit one example, its rows side by side along the token axis (zero-filled). Integers in a record — the
        single-query head-size hint — become ``None`` when a unit has several rows (their output gradients are not
        rank one across the rows); tags and ``None`` pass through."""
        several = idx.max_rows > 1

        def one(t):
            if torch.is_tensor(t):
                return idx.regroup(t)
            if several and isinstance(t, int) and not isinstance(t, bool):
                return None
            return t

        out = Layer(layer.module, layer.type)
        out.records = [tuple(one(t) for t in r) for r in layer.records]
        return out

    def _unit_index(self, units, rows: int | None = None):
        """The :class:`~hf_dp.clipping.common.UnitIndex` of ``units`` (``None``: one row per unit, nothing to do)."""
        if units is None:
            return None
        if rows is None:
            rows = next((int(t.shape[0]) for layer in self.layers for r in layer.records for t in r[:2]
                         if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] != 1), units.numel())
        return unit_index(units, rows)

    # ----- public -----------------------------------------------------------------------------------------
    def _collect(self, loss_scale: float, affine: dict | None = None, release: bool = False, units=None):
        idx = self._unit_index(units)
        if affine:
            owned = {id(p) for layer in self.layers for p in layer.params()}
            if any(id(p) not in owned for p in affine):
                raise ValueError("per-sample transform given for a parameter ghost clipping does not cover")
        work = Workspace(self.materialize_bytes, self.bounds)
        # Without a per-sample affine map every record's gradient is the loss scale s times the example's, so the
        # layers work on the records as they are and the scale is undone once: ‖v_i‖² = Σ_layers sq_i / s², the
        # clipped sum = f(c / s) — not one division of every output gradient (an LM head's is [B, T, vocab]) per layer.
        # (With an affine map the offset o is not scaled: the layers divide their records by s.)
        inner = loss_scale if affine else 1.0
        with _no_autocast():
            terms = []
            for layer in self.layers:
                work.bound_layer(layer.records, idx)
                grouped = layer if idx is None else self._grouped(layer, idx)
                terms.append(checked_terms(grouped, inner, affine, work))
                del grouped
                if release:  # the terms keep what they need (a scaled copy of g, when inner != 1)
                    layer.records.clear()
        del work  # the Gram cache
        sq = terms[0][0]
        for t in terms[1:]:
            sq = sq + t[0]
        if inner != loss_scale:
            k = 1.0 / loss_scale
            sq = sq * (k * k)
            terms = [(t[0], lambda c, _f=t[1], _k=k: _f(c * _k)) for t in terms]
        return _capped(sq, self._dtype()), terms

    def _dtype(self) -> torch.dtype:
        return _work_dtype(*(p.dtype for layer in self.layers for p in layer.params()))

    @torch.no_grad()
    def per_example_norms(self, loss_scale: float = 1.0, affine: dict | None = None, units=None) -> torch.Tensor:
        """‖v_i‖ per example — per unit with ``units``, [U] — v_i = ∇ℓ_i or its per-parameter affine transform (see
        :meth:`clipped_sum`)."""
        if self.two_pass:
            raise RuntimeError("a two-pass GhostClipper gives the norms from norms_pass")
        return self._collect(loss_scale, affine, units=units)[0].clamp_min(0).sqrt().to(self._dtype())

    @torch.no_grad()
    def clipped_sum(self, max_grad_norm: float, loss_scale: float = 1.0, affine: dict | None = None, units=None) -> dict:
        """{param: Σ_i c_i v_i}, c_i = min(1, C/(‖v_i‖·(1 + NORM_MARGIN) + 1e-6)) — 0 where ‖v_i‖² is not finite
        (see the module docstring: every example's contribution is finite with norm ≤ C); clears the records.

        ``units``: an integer tensor [rows], values 0..U−1 with every value present: the rows of one privacy unit
        are one "example" — v_u = (Σ_{r∈u} ∇ℓ_r + o) ⊙ s, its norm, clip factor and non-finite check per unit, the
        affine map applied once per unit (each layer's records regrouped by :meth:`_grouped`). ``None``: every row
        its own unit (the same computation as without the argument).

        v_i = ∇ℓ_i, or with ``affine={param: (o, s)}`` the per-sample vector of rules that transform
        each example's gradient by a public per-coordinate map before clipping: v_i = (∇ℓ_i + o) ⊙ s
        (o, s: tensors of the parameter's shape, s also a float, either ``None``) — DP-SGD-L2: o = λθ;
        DP-MacAdam: o = −m̂_{t−1}, s = 1/b_{t−1}. Exact: the norms expand into terms of the same
        records, and Σ_i c_i v_i = (Σ_i c_i ∇ℓ_i + (Σ_i c_i)·o) ⊙ s.
        """
        if self.two_pass:
            raise RuntimeError("a two-pass GhostClipper computes norms in norms_pass (see two_pass_clipped_sum)")
        sq, terms = self._collect(loss_scale, affine, release=True, units=units)
        c = clip_factors(sq, max_grad_norm)
        out: dict = {}
        with _no_autocast():
            terms.reverse()
            while terms:  # each layer's activations and output gradients are freed once its clipped sum exists
                out.update(terms.pop()[1](c))
            out = self._apply_affine(out, c, affine)
        self.clear()
        return out

    @staticmethod
    def _apply_affine(out: dict, c: torch.Tensor, affine: dict | None) -> dict:
        """Σ_i c_i v_i = (Σ_i c_i ∇ℓ_i + (Σ_i c_i)·o) ⊙ s for the parameters with a per-sample affine map."""
        for p, (o, sc) in (affine or {}).items():
            dt = _work_dtype(out[p].dtype, p.dtype)
            v = out[p].to(dt)
            if o is not None:
                v = v + c.to(dt).sum() * o.to(dt)
            if sc is not None:
                v = v * (sc if isinstance(sc, float) else sc.to(dt))
            out[p] = v.to(out[p].dtype)
        return out

    # ----- two passes (two_pass=True): no records kept (≈ 1.1× the non-private memory, see above) -----------
    def norms_pass(self, losses: torch.Tensor, affine: dict | None = None, units=None) -> torch.Tensor:
        """Pass 1 of two: ‖v_i‖² per example (``losses``: the per-example losses ℓ_i, shape [B]); with ``units``
        (see :meth:`clipped_sum`) ‖v_u‖² per unit, [U] — pass 2 is then the backward of Σ_r c_{units[r]} ℓ_r.

        One backward of Σ_i ℓ_i that computes no parameter gradient (``torch.autograd.grad`` towards the
        outputs of the lowest trainable layers only, so autograd skips every weight-gradient product) and
        keeps the graph; each layer's norm terms are computed from its input and output gradient as soon as
        they are known and then dropped, so nothing accumulates. Pass 2 is an ordinary backward of
        Σ_i c_i ℓ_i (c from :func:`clip_factors`, detached) through the same graph — same dropout masks —
        whose parameter gradients are exactly Σ_i c_i ∇ℓ_i; :meth:`grads_after_backward` collects them.
        The per-sample affine maps (``affine``, see :meth:`clipped_sum`) enter the norms here and the sum there.

        An example whose ‖v_i‖² comes out non-finite (c_i = 0) must contribute exactly 0 to pass 2, where
        0·∂ℓ_i = 0·NaN would carry NaN from its loss into every weight gradient: until the next forward or
        :meth:`grads_after_backward`, the layer hooks zero that example's output gradients, so every trainable
        layer's weight gradient sees exact zeros for it (its activations are finite whatever its loss)."""
        if not self.two_pass:
            raise RuntimeError("norms_pass needs GhostClipper(two_pass=True)")
        if affine:
            owned = {id(p) for layer in self.layers for p in layer.params()}
            if any(id(p) not in owned for p in affine):
                raise ValueError("per-sample transform given for a parameter ghost clipping does not cover")
        if not self._roots:
            raise ValueError("norms_pass needs a training-mode forward of the model (with grad enabled) first")
        idx = unit_index(units, losses.shape[0])
        self._phase, self._affine_now, self._sq, self._work = "norms", affine or {}, None, Workspace(bounds=self.bounds)
        self._units = idx
        try:
            torch.autograd.grad(losses.sum(), self._roots, retain_graph=True, allow_unused=True)
            missing = [type(layer.module).__name__ for layer in self.layers if not layer.done]
            if missing:
                raise ValueError(f"layers {missing} got no gradient in pass 1; is every trainable layer used in the forward?")
            sq = _capped(self._sq, self._dtype())
        finally:
            self._phase, self._affine_now, self._units = None, {}, None
            self.clear()
        zero = ~torch.isfinite(sq)  # exactly the examples (units) clip_factors gives c_i = 0
        if bool(zero.any()):
            self._zero_rows = zero if idx is None else idx.rows_of(zero)  # every row of such a unit
        return sq

    def grads_after_backward(self, c: torch.Tensor, loss_scale: float = 1.0, affine: dict | None = None) -> dict:
        """After pass 2 (a backward of ``loss_scale`` · Σ_i c_i ℓ_i): {param: Σ_i c_i v_i} from the parameters'
        ``.grad``, which are reset to ``None``.

        ``RuntimeError`` if pass 2 zeroed an example (see :meth:`norms_pass`) and a gradient is still not finite:
        that example's *activations* were non-finite (a forward overflow, not a loss), so its zeroed output
        gradients still met inf inside autograd's weight-gradient products — one pass and the hooks zero such an
        example's records themselves. (Checked only when an example was zeroed.)"""
        zero, self._zero_rows = self._zero_rows, None
        out = {}
        for layer in self.layers:
            for p in layer.params():
                if p.grad is None:
                    raise ValueError("a trainable parameter got no gradient in pass 2")
                out[p] = p.grad if loss_scale == 1.0 else p.grad / loss_scale
                p.grad = None
        if zero is not None and not all(bool(torch.isfinite(g).all()) for g in out.values()):
            raise RuntimeError(
                "two-pass ghost clipping cannot separate an example whose forward activations are not finite (its "
                "second backward multiplies them by zero, giving NaN); use --clipping ghost or --clipping hooks"
            )
        return self._apply_affine(out, c, affine)

    def two_pass_clipped_sum(self, losses: torch.Tensor, max_grad_norm: float, affine: dict | None = None, units=None) -> dict:
        """Both passes after a forward: {param: Σ_i min(1, C/(‖v_i‖+1e-6)) v_i} (as :meth:`clipped_sum`, also with
        ``units``)."""
        c = clip_factors(self.norms_pass(losses, affine, units=units), max_grad_norm)
        idx = unit_index(units, losses.shape[0])
        (losses * (c if idx is None else idx.rows_of(c))).sum().backward()
        return self.grads_after_backward(c, 1.0, affine)


def clip_factors(sq: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """c_i = min(1, C/(‖v_i‖·(1 + NORM_MARGIN) + 1e-6)) from squared ghost norms, detached; c_i = 0 where ‖v_i‖²
    is not finite (NaN, or inf: not representable in its dtype, ‖v_i‖ ≥ 2^64 in float32).

    Ghost norms are sums of terms of both signs (Gram products, the affine expansion), so their float32
    error can exceed a plain sum of squares'; the relative margin keeps c_i·‖v_i‖ ≤ C when the computed
    norm is up to 1e-5 (relative) short of the exact one. Finite norms get exactly the factor they always had."""
    norms = sq.detach().clamp_min(0).sqrt() * (1.0 + NORM_MARGIN)
    c = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), c, c.new_zeros(()))
