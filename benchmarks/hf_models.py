"""HF transformers' models under privkit's DP-SGD: which take book-keeping ghost clipping, how
close their norms are to per-example gradients', and one step against non-private SGD.

For each model family (a small configuration of its HF class, no pretrained weights):

* ``path``: ``ghost_clipping``, or ``torch.func`` and the reason ghost clipping refused it;
* ``max_relative_difference``: of the per-example gradient norms (float64, 6 examples) from the
  reference, ``torch.func``'s ``vmap(grad)`` or, where ``torch.func`` cannot batch the model
  (BART's boolean pooling), a loop over the examples;
* per step (float32, one torch thread, CPU time, medians of interleaved repeats): non-private SGD,
  privkit's ``DpSgdStep`` (seeded noise) as it clips the model, and the same step made to take
  ``torch.func`` (ghost clipping refused), with their ratios;
* with ``--memory``: each of the three's peak resident memory over two steps, each in a process
  of its own (Linux's ``VmHWM``, which a process starts afresh at ``exec``; ``ru_maxrss`` carries
  the parent's peak into its children), beside what the process held before its first step.
* with ``--trace-cost``: what following tensors of no example costs a model
  (:class:`~privkit.mechanisms.ghost_broadcast.BroadcastTrace`, which sees every torch operation
  of the forward pass to tell which hold examples): the model's forward and backward pass plain
  and under the trace with its input registered, medians of interleaved repeats, the ratio, and
  the operations the trace saw.

``python benchmarks/hf_models.py --json`` (results in ``benchmarks/results/hf_models_cpu.json``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from privkit.mechanisms import dp_sgd_step, ghost_broadcast, ghost_clipping
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.stacked import UnsupportedModelError

SCHEMA_VERSION = 1
TEXT, IMAGE, CAUSAL = "classifier on tokens", "classifier on images", "causal language model"


class Logits(nn.Module):
    """A HF model called on token ids (or pixel values), its logits out (for a causal language
    model with ``last``, the last position's: next-token prediction as a classifier). With
    ``positions`` its position ids are passed per example, ``(B, T)``: opacus' hooks take no
    ``(1, T)`` positions (privkit takes either)."""

    def __init__(self, model: nn.Module, kind: str, last: bool = False, positions: bool = False):
        super().__init__()
        self.model, self.kind, self.last, self.positions = model, kind, last, positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == IMAGE:
            return self.model(pixel_values=x).logits
        if self.model.config.is_encoder_decoder and self.kind == CAUSAL:  # T5: decode the input
            return self.model(input_ids=x, decoder_input_ids=x).logits
        ids = {"input_ids": x}
        if self.positions:
            ids["position_ids"] = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        logits = self.model(**ids).logits
        return logits[:, -1] if self.last else logits


def build(family: str, d: int = 32, layers: int = 2, vocab: int = 50, length: int = 32):
    """The HF model of ``family`` at width ``d`` (4 heads, MLP ``2d``), ``layers`` deep, and its
    kind (:data:`TEXT`, :data:`IMAGE`, :data:`CAUSAL`)."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, vocab_size=vocab)
    bert = dict(num_hidden_layers=layers, hidden_size=d, num_attention_heads=4)
    bert |= dict(intermediate_size=2 * d, max_position_embeddings=length + 2, num_labels=3, **ids)
    grouped = dict(num_hidden_layers=layers, hidden_size=d, num_attention_heads=4)
    grouped |= dict(num_key_value_heads=2, intermediate_size=2 * d, **ids)
    grouped |= dict(max_position_embeddings=length)
    vit = dict(image_size=32, patch_size=4, num_hidden_layers=layers, hidden_size=d)
    vit |= dict(num_attention_heads=4, intermediate_size=2 * d, num_labels=3)
    causal = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(  # no padding token, as GPT-2's
            n_layer=layers, n_embd=d, n_head=4, n_positions=length, bos_token_id=0,
            eos_token_id=2, vocab_size=vocab)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**grouped)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**grouped)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**grouped)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=d // 4, **grouped)),
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**{
            k: v for k, v in grouped.items() if k != "num_key_value_heads"})),
        "gpt_neo": lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            num_layers=layers, hidden_size=d, num_heads=4, max_position_embeddings=length,
            attention_types=[[["global", "local"], layers // 2]], **ids)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            num_hidden_layers=layers, hidden_size=d, num_attention_heads=4, ffn_dim=2 * d,
            max_position_embeddings=length, word_embed_proj_dim=d, **ids)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            num_layers=layers, d_model=d, num_heads=4, d_kv=d // 4, d_ff=2 * d, **ids)),
    }  # fmt: skip
    text = {
        "bert": lambda: tf.BertForSequenceClassification(tf.BertConfig(**bert)),
        "roberta": lambda: tf.RobertaForSequenceClassification(tf.RobertaConfig(**bert)),
        "electra": lambda: tf.ElectraForSequenceClassification(tf.ElectraConfig(
            embedding_size=d // 2, **bert)),
        "albert": lambda: tf.AlbertForSequenceClassification(tf.AlbertConfig(
            embedding_size=d // 2, **bert)),
        "distilbert": lambda: tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
            n_layers=layers, dim=d, n_heads=4, hidden_dim=2 * d,
            max_position_embeddings=length, num_labels=3, **ids)),
        "bart": lambda: tf.BartForSequenceClassification(tf.BartConfig(
            encoder_layers=layers // 2, decoder_layers=layers // 2, d_model=d,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d,
            decoder_ffn_dim=2 * d, max_position_embeddings=length, num_labels=3,
            scale_embedding=True, **ids)),
    }  # fmt: skip
    image = {
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(**vit)),
        "deit": lambda: tf.DeiTForImageClassification(tf.DeiTConfig(**vit)),
        "swin": lambda: tf.SwinForImageClassification(tf.SwinConfig(
            image_size=32, patch_size=4, embed_dim=d // 2, depths=[1, 1], num_heads=[2, 4],
            window_size=4, num_labels=3)),
        "convnext": lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
            num_stages=2, hidden_sizes=[d // 2, d], depths=[1, 1], num_labels=3)),
        "resnet": lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=d // 2, hidden_sizes=[d // 2, d], depths=[1, 1], num_labels=3)),
    }  # fmt: skip
    for kind, table in ((CAUSAL, causal), (TEXT, text), (IMAGE, image)):
        if family in table:
            return table[family]().eval(), kind
    raise ValueError(f"family must be one of {[*causal, *text, *image]}; found {family!r}")


FAMILIES = (
    "gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neo", "opt", "t5", "bert", "roberta",
    "electra", "albert", "distilbert", "bart", "vit", "deit", "swin", "convnext", "resnet",
)  # fmt: skip


def batch(kind: str, size: int, vocab: int, length: int, seed: int = 0):
    """Inputs and targets: tokens ending with the end-of-sequence token (BART's classifier reads
    it) and classes, or images and classes, or a sequence and itself (next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    if kind == IMAGE:
        return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 3, (size,), generator=g)
    x = torch.randint(3, vocab, (size, length), generator=g)
    if kind == CAUSAL:
        return x, x
    x[:, -1] = 2
    return x, torch.randint(0, 3, (size,), generator=g)


def record_loss(kind: str):
    """One record's loss for ``DpSgdStep`` (and torch.func): a causal model's mean next-token
    cross-entropy, else the class cross-entropy."""

    def causal(logits, y, _aux):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    def classes(logits, y, _aux):
        return F.cross_entropy(logits, y)

    return causal if kind == CAUSAL else classes


def looped(model, x, y, loss_fn, aux=None):
    """Per-example gradients by a loop over the examples (plain autograd, one at a time)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1], None)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (k, p), g in zip(params.items(), grads, strict=True):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(v) for k, v in rows.items()}


def example_losses(kind: str, y: torch.Tensor):
    """The batch's per-record losses from its logits (``ghost_clipping``'s form of
    :func:`record_loss`)."""
    if kind == CAUSAL:
        return lambda lo, s: F.cross_entropy(
            lo[:, :-1].transpose(1, 2), y[s][:, 1:], reduction="none"
        ).mean(1)
    return lambda lo, s: F.cross_entropy(lo, y[s], reduction="none")


def check(family: str) -> dict:
    """Which path privkit clips ``family``'s model by, and its norms' largest relative
    difference from the per-example gradients' (float64)."""
    torch.manual_seed(0)
    model, kind = build(family)
    model = Logits(model, kind).double()
    x, y = batch(kind, 6, 50, 12)
    x = x.double() if x.is_floating_point() else x
    loss = record_loss(kind)
    try:
        per, reference = dp_sgd_step.per_sample_gradients(model, x, y, loss), "torch.func"
    except RuntimeError as e:  # torch.func cannot batch it
        per, reference = looped(model, x, y, loss), f"a loop (torch.func: {str(e)[:80]})"
    want = dp_sgd_step.clip_per_sample(per, 1.0)[1]
    try:
        got = ghost_clipping.per_example_norms(model, x, example_losses(kind, y))
    except UnsupportedModelError as e:
        return {"kind": kind, "path": f"torch.func ({str(e)[:160]})", "reference": reference}
    difference = float(((got - want).abs() / want).max())
    return {
        "kind": kind,
        "path": "ghost_clipping",
        "reference": reference,
        "max_relative_difference": difference,
    }


def _steps(family: str, size: int, d: int, length: int, layers: int):
    """The model and one step of each variant: non-private SGD, privkit's DP-SGD as it clips the
    model, and the same step made to take torch.func (ghost clipping refused)."""
    torch.manual_seed(0)
    model, kind = build(family, d=d, vocab=1000, length=length, layers=layers)
    x, y = batch(kind, size, 1000, length)
    loss = record_loss(kind)
    step = DpSgdStep(1.0, 1.0, size / 10_000, 10_000)
    noise = torch.Generator().manual_seed(0)
    models = {v: copy.deepcopy(Logits(model, kind)) for v in ("sgd", "privkit", "torch_func")}
    opts = {v: torch.optim.SGD(m.parameters(), lr=0.01) for v, m in models.items()}

    def sgd():
        opts["sgd"].zero_grad(set_to_none=True)
        loss(models["sgd"](x), y, None).backward()
        opts["sgd"].step()

    def privkit():
        step.apply(models["privkit"], opts["privkit"], x, y, loss, noise)

    def torch_func():
        refuse = ghost_clipping.clipped_sum
        ghost_clipping.clipped_sum = _refused  # type: ignore[assignment]
        try:
            step.apply(models["torch_func"], opts["torch_func"], x, y, loss, noise)
        finally:
            ghost_clipping.clipped_sum = refuse

    return model, {"sgd": sgd, "privkit": privkit, "torch_func": torch_func}


def timed_steps(family: str, repeats: int, size: int, d: int, length: int, layers: int) -> dict:
    """One step's CPU time: non-private SGD, privkit's DP-SGD as it clips the model, and the
    same step made to take torch.func (ghost clipping refused); medians, ratios."""
    model, fns = _steps(family, size, d, length, layers)
    unavailable = {}
    for v, fn in list(fns.items()):
        try:
            fn()
        except RuntimeError as e:  # torch.func cannot batch the model (BART)
            if v != "torch_func":  # SGD and privkit's own path never fail here
                raise
            unavailable[v] = str(e)[:120]
            del fns[v]
    times: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(repeats):
        for v, fn in fns.items():
            start = time.process_time()
            fn()
            times[v].append(time.process_time() - start)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "median_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "vs_sgd": {
            v: statistics.median(a / b for a, b in zip(t, times["sgd"], strict=True))
            for v, t in times.items()
        },
        "unavailable": unavailable,
    }


class _Operations(TorchFunctionMode):
    """Counts the torch operations called within it (what a trace's ``__torch_function__`` sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def trace_cost(family: str, repeats: int, size: int, d: int, length: int, layers: int) -> dict:
    """The model's forward and backward pass (float32, CPU time) plain and under a
    :class:`~privkit.mechanisms.ghost_broadcast.BroadcastTrace` with the input registered as the
    batch: every operation of the forward then takes the trace's check, as in a step of a model
    with a followed tensor. Medians of interleaved repeats, the ratio, the operations seen."""
    torch.manual_seed(0)
    model, kind = build(family, d=d, vocab=1000, length=length, layers=layers)
    x, _ = batch(kind, size, 1000, length)
    logits = Logits(model, kind)

    def plain() -> None:
        logits(x).sum().backward()

    def traced() -> None:
        trace = ghost_broadcast.BroadcastTrace(size)
        with trace:
            trace.batch(x)
            out = logits(x)
        out.sum().backward()

    with _Operations() as seen:
        logits(x)
    times: dict[str, list[float]] = {"plain": [], "traced": []}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in (("plain", plain), ("traced", traced)):
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    plain_ms, traced_ms = (1e3 * statistics.median(times[k][1:]) for k in ("plain", "traced"))
    return {
        "plain_ms": plain_ms,
        "traced_ms": traced_ms,
        "ratio": statistics.median(
            a / b for a, b in zip(times["traced"][1:], times["plain"][1:], strict=True)
        ),
        "operations": seen.count,
        "us_per_operation": 1e3 * (traced_ms - plain_ms) / seen.count,
    }


def _peak_gb() -> float:
    """This process' peak resident memory so far, GB: ``VmHWM`` (its own since ``exec``), else
    ``ru_maxrss`` (which on Linux includes the parent's peak at ``fork``)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory(family: str, variant: str, size: int, d: int, length: int, layers: int) -> dict:
    """In this process: the memory held before the first step and the peak over two steps of
    ``variant`` (GB); run by :func:`memory` in a process of its own per variant."""
    _, fns = _steps(family, size, d, length, layers)
    before = _peak_gb()
    for _ in range(2):
        fns[variant]()
    return {"before_gb": round(before, 3), "peak_gb": round(_peak_gb(), 3)}


def memory(family: str, args) -> dict:
    """Each variant's :func:`peak_memory`, each in a fresh process (a peak is per process)."""
    out = {}
    for variant in ("sgd", "privkit", "torch_func"):
        shape = [f"--{k}={getattr(args, k)}" for k in ("batch", "width", "length", "layers")]
        run = subprocess.run(
            [sys.executable, __file__, f"--peak-of={family},{variant}", *shape],
            capture_output=True,
            text=True,
            check=False,
        )
        out[variant] = json.loads(run.stdout) if run.returncode == 0 else run.stderr[-200:]
    return out


def _refused(*_args, **_kwargs):
    raise UnsupportedModelError("refused for the benchmark's torch.func row")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--check-only", action="store_true", help="the paths and norms, no timing")
    ap.add_argument("--memory", action="store_true", help="also each step's peak memory")
    ap.add_argument(
        "--trace-cost", action="store_true", help="also what following tensors costs a pass"
    )
    ap.add_argument("--peak-of", help=argparse.SUPPRESS)  # FAMILY,VARIANT: one process's peak
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name in ("repeats", "batch", "width", "length", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; found {getattr(args, name)}")  # exit code 2
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        ap.error(f"--families must be among {','.join(FAMILIES)}; found {unknown[0]}")
    if importlib.util.find_spec("transformers") is None:
        raise SystemExit("benchmarks/hf_models.py needs transformers: pip install -e '.[test]'")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers

    if args.peak_of:
        family, variant = args.peak_of.split(",")
        shape = (args.batch, args.width, args.length, args.layers)
        print(json.dumps(peak_memory(family, variant, *shape)))
        return

    results = {}
    for family in args.families.split(","):
        results[family] = check(family)
        if not args.check_only:
            results[family] |= timed_steps(
                family, args.repeats, args.batch, args.width, args.length, args.layers
            )
        if args.memory:
            results[family]["memory"] = memory(family, args)
        if args.trace_cost:
            shape = (args.batch, args.width, args.length, args.layers)
            results[family]["trace_cost"] = trace_cost(family, args.repeats, *shape)
        if not args.json:
            r = results[family]
            ratios = " ".join(f"{v} {x:.2f}x" for v, x in r.get("vs_sgd", {}).items() if v != "sgd")
            print(f"{family:10s} {r['path'][:70]:70s} {ratios}")
    out = {
        "schema_version": SCHEMA_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": 1,
        "setup": {
            "check": "float64, 6 examples, width 32, 2 layers, 12 tokens, vocabulary 50",
            "steps": f"float32, batch {args.batch}, width {args.width}, {args.layers} layers, "
            f"{args.length} tokens (32x32x3 images), vocabulary 1000; {args.repeats} "
            "interleaved repeats after one warm-up, this process' CPU time",
            "clip_norm": 1.0,
            "noise_multiplier": 1.0,
        },
        "families": results,
    }
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
