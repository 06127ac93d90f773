"""One DP-SGD step of models people train: privkit against opacus and non-private SGD.

Per step, on one fixed batch (the expected size of a Poisson batch; every variant takes the same
examples), measured in one run with interleaved repeats (each repeat runs every variant once, in
turn, so drifts of the machine hit all of them alike), medians:

* ``sgd``: non-private SGD (mean cross-entropy, one backward pass, ``optimizer.step``);
* ``opacus_hooks``: opacus ``make_private(grad_sample_mode="hooks")``: per-example gradients by
  module hooks, flat clipping, noise, ``optimizer.step``;
* ``opacus_ghost``: opacus ``make_private(grad_sample_mode="ghost")``: ghost norms, then a second
  backward pass with the clipped losses;
* ``privkit``: :meth:`privkit.mechanisms.dp_sgd_step.DpSgdStep.apply` with release noise
  (:meth:`privkit.mechanisms.dp_random.DpRandom.secret`: on the CPU the AES stream on the floating-point
  grid, on a GPU the ChaCha20 stream on the device), the per-example norms and the clipped sum by
  book-keeping ghost clipping (:mod:`privkit.mechanisms.ghost_clipping`: one forward, one backward
  pass);
* ``privkit_seeded``: the same with a seeded ``torch.Generator`` (reproducible mode);
* ``privkit_replay``, ``privkit_replay_seeded``: the two above with the clipped sum replayed
  (:class:`privkit.mechanisms.step_replay.StepReplay`: traced once for the batch's size in the
  warm-up, its replay checked there too), the trace run by TorchScript's interpreter;
* ``privkit_replay_python_seeded``: the seeded replay with the trace run as its Python code
  (``StepReplay(script=False)``).

Ratios: each variant's median over non-private SGD's and over opacus ghost's (the per-repeat ratio
of the interleaved pairs, median). A variant that refuses a model (opacus' ghost clipping refuses
tied parameters) is left out with its reason under ``unavailable``. ``privkit_path`` says which clipped-sum path privkit took for the
model (``ghost_clipping``, else the ``torch.func`` fallback).

Models: ``resnet_small`` (a GroupNorm ResNet of 78k parameters, 32x32x3 inputs, batch 64);
``resnet_small_bn`` (the same with BatchNorm in eval mode, its statistics frozen as in
fine-tuning a pretrained network; opacus refuses BatchNorm and trains it as its
``ModuleValidator.fix`` makes it, with GroupNorm); ``resnet_small_ws`` (the GroupNorm ResNet
with every convolution's weight standardised by a ``torch.nn.utils.parametrize``
parametrization, De et al. 2022's DP recipe; opacus' hooks fail on parametrized weights);
``transformer`` (a transformer-block classifier: token and position embeddings, LayerNorm,
4-head attention by ``nn.Linear`` q/k/v/out maps, MLP; 64 tokens, batch 64); ``encoder`` (the
same block as torch's ``nn.TransformerEncoderLayer`` builds it, its ``nn.MultiheadAttention``
included: opacus trains it as its ``ModuleValidator.fix`` replaces the attention, by
``DPMultiheadAttention``); ``vit`` (torchvision's vision transformer at a small size: 4x4
patches of 32x32x3 images, a class token and a position embedding as bare parameters, two such
encoder layers, 0.41M parameters, batch 64); ``lm`` (nanoGPT in small: vocab 5000, width 128, two
causal blocks, 64 tokens, its output layer tied to the token embedding as GPT-2's, each example's
loss the mean next-token cross-entropy of its sequence; 1.05M parameters, batch 32); ``gpt2``
(HF transformers' ``GPT2LMHeadModel`` at ``lm``'s size, no pretrained weights: its attention and
MLP maps are ``Conv1D`` layers, a linear map with its weight stored ``(in, out)``; 1.06M
parameters, batch 32); ``lstm``
(a text classifier on opacus' ``DPLSTM``, whose cells' ``nn.Linear`` maps run once per time
step: vocab 1000, width 64, hidden 128, 32 tokens, 0.16M parameters, batch 64); with ``--big``
``resnet18`` (ResNet-18 with GroupNorm, 11.2M parameters, 32x32x3 inputs, batch 256: about a
minute per repeat on one CPU thread, the model of issue 32's GPU figures), ``encoder_large``
(two such layers of width 512, 8 heads, 6.9M parameters, 128 tokens, batch 32) and ``vit_large``
(the ViT at width 384, 6 heads, 4 layers, 7.1M parameters, batch 32), ``gpt2_small`` (HF's
GPT-2 at its small size, 124M parameters, 64 tokens, batch 4) and ``gpt2_small_lora`` (the same
with PEFT's LoRA adapters of rank 8 on its attention maps, the base frozen: DP fine-tuning as
it is mostly done); ``cnn3d`` (a 3-d CNN of medical imaging's kind: MedMNIST-3D's 28x28x28
volumes, three ``Conv3d`` layers with GroupNorm and a PReLU of one slope per channel, 70k
parameters, batch 32); ``lstm_torch`` (the ``lstm`` classifier on torch's own ``nn.LSTM``, which
opacus trains as its ``ModuleValidator.fix`` makes it, with ``DPLSTM``); ``lstm_cell`` (the same
classifier with torch's ``nn.LSTMCell`` called once per token by the model's own loop; opacus
trains it with its ``DPLSTMCell`` of the same weights); ``encoder_seq_first`` (``encoder``
sequence-first, ``batch_first=False`` as torch's tutorials build it; opacus, whose hooks take the
batch on every layer's first dimension, trains its batch-first twin of the same weights);
``lstm_packed`` (``lstm_torch`` on texts of 8 to 32 tokens padded with 0 and packed by
``pack_padded_sequence``, its final state to the head; opacus on its ``DPLSTM`` form, which takes
packed sequences); ``lstm_stacked`` (``lstm_torch`` with two layers and dropout 0.3 between them in
training mode); ``fasttext`` (a fastText-style text classifier: the mean of 64 tokens' embeddings
by ``nn.EmbeddingBag``, vocabulary 20,000, width 64, 1.28M parameters, batch 64).

``--torch-func`` adds ``privkit_torch_func_seeded``: the seeded step with the clipped sum from
``torch.func``'s per-example gradients of the whole model, what privkit computes for a model
ghost clipping refuses (and computed for ``cnn3d`` before privkit had rules for ``Conv3d`` and
``PReLU``); every example's gradient is held, so for small models only.

    python benchmarks/dpsgd_step.py --json [--device cuda] [--repeats 7] [--big] [--host-bound]

A line on stderr follows each model measured (``--big``: ResNet-18 first). Stopped by SIGTERM (a
lent machine's time limit, ``timeout``), the run still writes its JSON: the models it measured,
and under ``stopped`` which it did not.

``--autocast`` runs every variant's step under ``torch.autocast`` in bfloat16 (mixed
precision: the forward and backward passes in half precision; privkit forms each record's norm
and contribution in float32 from them); a variant of opacus that fails under it is left out
with its error under ``unavailable``.

``--host-bound`` (on the CPU) measures what bounds a step on a GPU that waits for its host: the
host's own work. Each model at 4 records, images cropped to 8x8 and sequences to 8 positions (the
ViT keeps its 32x32 images, its position embedding's length), so that the kernels are a small
part of each step and its time is mostly Python, torch's dispatch and the operations' fixed
costs, as when a GPU runs the kernels; privkit takes its GPU forms
(``device_waits.gpu_forms``: the convolutions' offsets). The ratios to SGD then say how much more
host time a step takes. Seeded noise only: release noise's ChaCha20 stream is computed by torch's
operations on a CPU (about 1,100 of them a draw, and the whole draw's arithmetic), where a GPU
runs one Triton kernel.

On the CPU torch runs one thread and a step's time is the process's CPU time (the machines this
was written on are shared: wall time there measures the neighbours); with ``--threads N`` (N > 1)
torch runs N threads and a step's time is wall time (CPU time would add the threads' up); on a
GPU, wall time between synchronisations. ``benchmarks/results/dpsgd_step_cpu.json`` is this repository's
CPU run, ``dpsgd_step_cuda.json`` its GPU run (``--device cuda --big --json --repeats 15`` on an
NVIDIA H200, by ``benchmarks/run_gpu.sh``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import platform
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from hf_models import CAUSAL, Logits  # the same directory: run as a script
from torch import nn

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import ClippingFallbackWarning, DpSgdStep
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.mechanisms.step_replay import StepReplay
from privkit.memory import keep_freed_memory

SCHEMA_VERSION = 1
CLIP, SIGMA, LR, DATASET = 1.0, 1.0, 0.05, 50_000
VARIANTS = (
    "sgd",
    "opacus_hooks",
    "opacus_ghost",
    "privkit",
    "privkit_seeded",
    "privkit_replay",
    "privkit_replay_seeded",
    "privkit_replay_python_seeded",
)
#: ``--torch-func``'s variant: the seeded step clipped from the whole model's per-example
#: gradients by ``torch.func``
TORCH_FUNC = "privkit_torch_func_seeded"


def _norm(groups: int, c: int) -> nn.Module:
    """GroupNorm of ``min(groups, c)`` groups, or BatchNorm where ``groups`` is 0."""
    return nn.BatchNorm2d(c) if groups == 0 else nn.GroupNorm(min(groups, c), c)


class Block(nn.Module):
    """ResNet's basic block with GroupNorm for BatchNorm (``groups`` 0: BatchNorm) (ReLUs not in
    place: opacus' hooks refuse an in-place operation on a hooked layer's output)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = _norm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = _norm(groups, c_out)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(groups, c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out = out + self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    """CIFAR-style ResNet (3x3 stem, no max-pool) with GroupNorm: ``blocks`` per stage."""

    def __init__(self, widths: tuple[int, ...], blocks: int, groups: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), _norm(groups, widths[0]), nn.ReLU()
        )
        layers, c = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                layers.append(Block(c, w, 2 if i > 0 and j == 0 else 1, groups))
                c = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class TransformerClassifier(nn.Module):
    """Token and position embeddings, one pre-norm transformer block (attention by ``nn.Linear``
    q/k/v/out maps, GELU MLP), mean pooling, a linear head."""

    def __init__(self, vocab=1000, d=128, heads=4, length=64, classes=10):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)
        self.heads = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).repeat(b, 1)  # contiguous: opacus ghost views it
        h = self.tok(idx) + self.pos(pos)
        z = self.ln1(h)

        def split(u):
            return u.view(b, t, self.heads, -1).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(z)), split(self.k(z)), split(self.v(z)))
        h = h + self.o(att.transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(self.ln_f(h).mean(1))


class EncoderClassifier(nn.Module):
    """Token and position embeddings, torch's ``nn.TransformerEncoderLayer`` (its
    ``nn.MultiheadAttention``; batch-first, pre-norm, GELU), mean pooling, a linear head: the
    transformer block above as torch's modules build it. With ``batch_first=False`` the same
    model sequence-first, as torch's tutorials write it: every layer on ``(T, B, d)``."""

    def __init__(
        self, vocab=1000, d=128, heads=4, length=64, classes=10, layers=1, batch_first=True
    ):
        super().__init__()
        self.sizes = {"vocab": vocab, "d": d, "heads": heads, "length": length}
        self.sizes |= {"classes": classes, "layers": layers}
        self.batch_first = batch_first
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=batch_first,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).repeat(b, 1)
        if not self.batch_first:
            idx, pos = idx.T, pos.T
        h = self.ln_f(self.blocks(self.tok(idx) + self.pos(pos)))
        return self.head(h.mean(1 if self.batch_first else 0))

    def batch_first_twin(self) -> EncoderClassifier:
        """The same model (its weights) batch-first: the form opacus trains, whose hooks take
        the batch on the first dimension of every layer's input."""
        twin = EncoderClassifier(**self.sizes, batch_first=True)
        twin.load_state_dict(self.state_dict())
        return twin.to(self.head.weight.device)


class VisionTransformer(nn.Module):
    """torchvision's ViT at a small size: 4x4 patches by a strided convolution, a class token and
    a position embedding as bare parameters (``nn.Parameter`` of the model itself), batch-first
    pre-norm ``nn.TransformerEncoderLayer``s, the class token's head."""

    def __init__(self, d=128, heads=4, patch=4, size=32, classes=10, layers=2):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(0.02 * torch.randn(1, (size // patch) ** 2 + 1, d))
        block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.ln(self.encoder(x + self.pos_embedding))[:, 0])


class CausalBlock(nn.Module):
    """nanoGPT's block: pre-norm causal self-attention by one ``nn.Linear`` to q, k and v and one
    out of it, then a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape

        def split(u):
            return u.view(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = (split(u) for u in self.c_attn(self.ln_1(h)).split(d, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.c_proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h))))


class LanguageModel(nn.Module):
    """nanoGPT in small: token and position embeddings, causal blocks, a final LayerNorm, and an
    output layer on every position whose weight is the token embedding's (tied, as GPT-2's)."""

    def __init__(self, vocab=5000, d=128, heads=4, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.blocks = nn.Sequential(*(CausalBlock(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):  # GPT-2's initialisation (N(0, 1) embeddings give the
            nn.init.normal_(emb.weight, std=0.02)  # tied head logits of std 11: denormal gradients)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).repeat(b, 1)  # per example (nanoGPT broadcasts)
        return self.lm_head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


class LSTMClassifier(nn.Module):
    """A text classifier on opacus' ``DPLSTM`` (its LSTM of ``nn.Linear`` cells, run once per
    time step; with ``torch_lstm`` torch's own ``nn.LSTM``): token embeddings, one layer (or
    ``layers``, with ``dropout`` between them), the last step's output to a linear head."""

    def __init__(
        self, vocab=1000, d=64, hidden=128, classes=10, torch_lstm=False, layers=1, dropout=0.0
    ):
        from opacus.layers import DPLSTM

        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        lstm = nn.LSTM if torch_lstm else DPLSTM
        self.lstm = lstm(d, hidden, num_layers=layers, dropout=dropout, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(idx))[0][:, -1])


class PackedLSTMClassifier(LSTMClassifier):
    """The ``lstm_torch`` classifier on texts of different lengths, as NLP code feeds an LSTM: the
    padded token ids (0 the padding) packed by their lengths (``pack_padded_sequence``), the last
    layer's final state to the head."""

    def __init__(self):
        super().__init__(torch_lstm=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        lengths = (idx != 0).sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.emb(idx), lengths, batch_first=True, enforce_sorted=False
        )
        return self.head(self.lstm(packed)[1][0][-1])


class CellLoopClassifier(nn.Module):
    """The ``LSTMClassifier`` written as its users write a recurrence of their own: torch's
    ``nn.LSTMCell`` called once per token by the model's loop, from the cell's zero state."""

    def __init__(self, vocab=1000, d=64, hidden=128, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.cell: nn.Module = nn.LSTMCell(d, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        tokens, state = self.emb(idx), None
        for t in range(tokens.shape[1]):
            state = self.cell(tokens[:, t]) if state is None else self.cell(tokens[:, t], state)
        return self.head(state[0])


def opacus_cells(model: nn.Module) -> nn.Module:
    """``model`` with each ``nn.LSTMCell`` replaced by opacus' ``DPLSTMCell`` of the same weights
    (its drop-in replacement, of ``nn.Linear``-like maps its hooks see; opacus' validator leaves
    cells as they are and its hooks have no rule for them)."""
    from opacus.layers.dp_rnn import DPLSTMCell

    for name, child in list(model.named_children()):
        if type(child) is nn.LSTMCell:
            cell = DPLSTMCell(child.input_size, child.hidden_size, child.bias)
            with torch.no_grad():
                for kind in ("ih", "hh"):
                    getattr(cell, kind).weight.copy_(getattr(child, f"weight_{kind}"))
                    if child.bias:
                        getattr(cell, kind).bias.copy_(getattr(child, f"bias_{kind}"))
            setattr(model, name, cell.to(child.weight_ih.device))
        else:
            opacus_cells(child)
    return model


class BagClassifier(nn.Module):
    """A fastText-style text classifier: the mean of each text's token embeddings
    (``nn.EmbeddingBag``), then a linear head."""

    def __init__(self, vocab: int = 20_000, d: int = 64, classes: int = 10):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean")
        self.head = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(idx))


class VolumeCNN(nn.Module):
    """A 3-d CNN of medical imaging's kind (MedMNIST-3D's 28x28x28 volumes, one channel, 11
    classes): three 3x3x3 convolutions (16, 32, 64 channels; the last two of stride 2), each
    followed by GroupNorm and a PReLU of one slope per channel, pooled to a linear head."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 11):
        super().__init__()
        layers, c = [], 1
        for i, w in enumerate(widths):
            layers += [nn.Conv3d(c, w, 3, 1 if i == 0 else 2, 1), nn.GroupNorm(4, w), nn.PReLU(w)]
            c = w
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool3d(self.features(x), 1).flatten(1))


class Standardised(nn.Module):
    """Weight standardisation as a parametrization: each output unit's weights less their mean,
    over their standard deviation (De et al. 2022's DP image classifiers: standardised
    convolutions and GroupNorm)."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(1, w.dim()))
        mean, var = w.mean(dims, keepdim=True), w.var(dims, keepdim=True, unbiased=False)
        return (w - mean) / torch.sqrt(var + 1e-5)


def _standardised(model: nn.Module) -> nn.Module:
    """``model`` with every convolution's weight standardised (``parametrize``)."""
    from torch.nn.utils import parametrize

    for m in list(model.modules()):
        if isinstance(m, nn.Conv2d):
            parametrize.register_parametrization(m, "weight", Standardised())
    return model


def _statistics_frozen(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with its BatchNorm statistics those of a few batches of random
    images: a pretrained network's, frozen for fine-tuning."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(64, 3, 32, 32, generator=g))
    return model.eval()


def gpt2(vocab=5000, d=128, heads=4, layers=2) -> nn.Module:
    """HF transformers' GPT-2 (``GPT2LMHeadModel``, no pretrained weights) at the size of ``lm``:
    its maps are ``Conv1D`` layers, its head is tied to the token embedding, its positions are
    ``(1, T)`` ids; no dropout (as ``lm``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=d, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Logits(transformers.GPT2LMHeadModel(config), CAUSAL, positions=True)


def lora(model: Logits, targets: list[str], r: int = 8) -> Logits:
    """``model`` with LoRA adapters of rank ``r`` on the ``targets`` maps (PEFT's
    ``get_peft_model``): only the adapters train, the base model frozen."""
    import peft

    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, fan_in_fan_out=True)
    model.model = peft.get_peft_model(model.model, config)
    return model


def build(name: str) -> tuple[nn.Module, str, int]:
    """The model, a description, and its batch size."""
    if name == "resnet18":
        return ResNet((64, 128, 256, 512), 2, 32), "ResNet-18, GroupNorm(32), 32x32x3", 256
    if name == "resnet_small":
        return ResNet((16, 32, 64), 1, 4), "ResNet 16-32-64, 1 block/stage, GroupNorm(4)", 64
    if name == "resnet_small_ws":
        return (
            _standardised(ResNet((16, 32, 64), 1, 4)),
            "ResNet 16-32-64, 1 block/stage, GroupNorm(4), every convolution's weight "
            "standardised by a parametrization (torch.nn.utils.parametrize)",
            64,
        )
    if name == "resnet_small_bn":
        return (
            _statistics_frozen(ResNet((16, 32, 64), 1, 0)),
            "ResNet 16-32-64, 1 block/stage, BatchNorm in eval mode (statistics frozen, as in "
            "fine-tuning a pretrained network); opacus trains it as ModuleValidator.fix makes it, "
            "with GroupNorm",
            64,
        )
    if name == "transformer":
        return (
            TransformerClassifier(),
            "transformer block: vocab 1000, d 128, 4 heads, MLP 512, 64 tokens",
            64,
        )
    if name == "encoder":
        return (
            EncoderClassifier(),
            "nn.TransformerEncoderLayer: vocab 1000, d 128, 4 heads, MLP 512, 64 tokens",
            64,
        )
    if name == "encoder_seq_first":
        return (
            EncoderClassifier(batch_first=False),
            "nn.TransformerEncoderLayer sequence-first (batch_first=False, torch's default): "
            "vocab 1000, d 128, 4 heads, MLP 512, 64 tokens; opacus trains its batch-first twin",
            64,
        )
    if name == "encoder_large":
        return (
            EncoderClassifier(d=512, heads=8, length=128, layers=2),
            "2 nn.TransformerEncoderLayers: vocab 1000, d 512, 8 heads, MLP 2048, 128 tokens",
            32,
        )
    if name == "vit":
        return (
            VisionTransformer(),
            "ViT: 32x32x3 in 4x4 patches, d 128, 4 heads, MLP 512, 2 layers, class token and "
            "position embedding",
            64,
        )
    if name == "vit_large":
        return (
            VisionTransformer(d=384, heads=6, layers=4),
            "ViT: 32x32x3 in 4x4 patches, d 384, 6 heads, MLP 1536, 4 layers, class token and "
            "position embedding",
            32,
        )
    if name == "fasttext":
        return (
            BagClassifier(),
            "fastText-style classifier: EmbeddingBag mean of 64 tokens, vocab 20000, d 64",
            64,
        )
    if name == "cnn3d":
        return (
            VolumeCNN(),
            "3-d CNN: 1x28x28x28 volumes, Conv3d 16-32-64, GroupNorm(4), PReLU per channel",
            32,
        )
    if name == "lstm_torch":
        return (
            LSTMClassifier(torch_lstm=True),
            "torch's nn.LSTM: vocab 1000, d 64, hidden 128, 32 tokens, last step's output; opacus "
            "trains it as ModuleValidator.fix makes it, with DPLSTM",
            64,
        )
    if name == "lstm_stacked":
        return (
            LSTMClassifier(torch_lstm=True, layers=2, dropout=0.3),
            "torch's nn.LSTM of 2 layers with dropout 0.3 between them: vocab 1000, d 64, hidden "
            "128, 32 tokens; opacus trains it with DPLSTM",
            64,
        )
    if name == "lstm_packed":
        return (
            PackedLSTMClassifier(),
            "torch's nn.LSTM on packed texts of 8 to 32 tokens (pack_padded_sequence): vocab 1000, "
            "d 64, hidden 128, the final state; opacus trains it with DPLSTM",
            64,
        )
    if name == "lstm_cell":
        return (
            CellLoopClassifier(),
            "torch's nn.LSTMCell in the model's loop over 32 tokens: vocab 1000, d 64, hidden "
            "128, the last state; opacus trains it with its DPLSTMCell",
            64,
        )
    if name == "lstm":
        return (
            LSTMClassifier(),
            "opacus' DPLSTM: vocab 1000, d 64, hidden 128, 32 tokens, last step's output",
            64,
        )
    if name == "lm":
        return (
            LanguageModel(),
            "nanoGPT: vocab 5000, d 128, 4 heads, MLP 512, 2 causal blocks, 64 tokens, output "
            "layer tied to the token embedding, next-token loss on every position",
            32,
        )
    if name == "gpt2_small_lora":
        return (
            lora(cast(Logits, gpt2(vocab=50257, d=768, heads=12, layers=12)), ["c_attn"]),
            "GPT-2 small (124M) with LoRA adapters of rank 8 on its attention maps (PEFT), the "
            "base model frozen: 295k trainable parameters; 64 tokens",
            4,
        )
    if name == "gpt2_small":
        return (
            gpt2(vocab=50257, d=768, heads=12, layers=12),
            "HF transformers' GPT2LMHeadModel at GPT-2 small's size (124M): vocab 50257, d 768, "
            "12 heads, 12 layers, 64 tokens, next-token loss on every position",
            4,
        )
    if name == "gpt2":
        return (
            gpt2(),
            "HF transformers' GPT2LMHeadModel: vocab 5000, d 128, 4 heads, 2 layers, 64 tokens, "
            "Conv1D maps, head tied to the token embedding, next-token loss on every position",
            32,
        )
    raise ValueError(name)


def batch(name: str, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name in ("lm", "gpt2", "gpt2_small", "gpt2_small_lora"):  # a sequence and its next tokens
        vocab = 50257 if name.startswith("gpt2_small") else 5000
        tokens = torch.randint(0, vocab, (size, 65), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    texts = ("transformer", "encoder", "encoder_seq_first", "encoder_large", "lstm", "lstm_torch")
    texts += ("lstm_cell", "lstm_packed", "lstm_stacked")
    if name in (*texts, "fasttext"):
        lengths = {"encoder_large": 128, "lstm": 32, "lstm_torch": 32, "lstm_cell": 32}
        length = (lengths | {"lstm_packed": 32, "lstm_stacked": 32}).get(name, 64)
        vocab = 20_000 if name == "fasttext" else 1000
        x = torch.randint(int(name == "lstm_packed"), vocab, (size, length), generator=g)
        if name == "lstm_packed":  # each text 8 to 32 tokens, padded with 0
            kept = torch.randint(8, length + 1, (size, 1), generator=g)
            x = x.masked_fill(torch.arange(length) >= kept, 0)
    elif name == "cnn3d":  # volumes
        x = torch.randn(size, 1, 28, 28, 28, generator=g)
    else:
        x = torch.randn(size, 3, 32, 32, generator=g)
    return x.to(device), torch.randint(0, 10, (size,), generator=g).to(device)


def _per_example_loss(logits, y, _aux):
    """Cross-entropy of class logits, or of a language model's logits on every position (its
    mean over the positions: each example's loss)."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


@contextmanager
def _torch_func_only() -> Iterator[None]:
    """Within the block, DP-SGD's clipped sums from ``torch.func``'s per-example gradients of the
    whole model (``--torch-func``): what privkit computes for a model ghost clipping refuses, and
    computed for any model with a layer of torch's own it had no rule for (a ``Conv3d``, a
    ``PReLU``, BatchNorm in eval mode) before they had theirs."""

    def refuse(*_args, **_kwargs):
        raise UnsupportedModelError("--torch-func")

    real = ghost_clipping.clipped_sum
    ghost_clipping.clipped_sum = refuse
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ClippingFallbackWarning)
            yield
    finally:
        ghost_clipping.clipped_sum = real


class OpacusRefusal(Exception):
    """opacus cannot set the model up for training (its ``ModuleValidator.fix`` copies a model by
    pickling it, which a parametrized model refuses): the variant is left out with the reason."""


def _refuse(why: str) -> None:
    """A variant that opacus could not set up: raises :class:`OpacusRefusal` when run."""
    raise OpacusRefusal(why)


def steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, torch_func=False
) -> dict:
    """One step function per variant, each on its own copy of ``model`` (``torch_func``: and
    the seeded step with the whole model's per-example gradients by ``torch.func``)."""
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    n = x.shape[0]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=n
    )
    out = {}

    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)

    def sgd():
        opt.zero_grad(set_to_none=True)
        _per_example_loss(plain(x), y, None).backward()  # the batch's mean: SGD's loss
        opt.step()

    out["sgd"] = sgd
    frozen_statistics = any(
        isinstance(layer, nn.modules.batchnorm._BatchNorm) and not layer.training
        for layer in model.modules()
    )
    for mode in ("hooks", "ghost"):
        # opacus takes nn.MultiheadAttention only as its DPMultiheadAttention (nn.Linear maps):
        # its documented replacement, the same function and weights
        twin = getattr(model, "batch_first_twin", None)
        m = copy.deepcopy(model) if twin is None or model.batch_first else twin()
        try:
            m = opacus_cells(ModuleValidator.fix(m))
        except RuntimeError as e:  # its copy of the model pickles it: not a parametrized one
            out[f"opacus_{mode}"] = functools.partial(_refuse, f"ModuleValidator.fix: {e}")
            continue
        if frozen_statistics:  # its BatchNorm now GroupNorm: opacus asks for training mode
            m.train()
        o = torch.optim.SGD(m.parameters(), lr=LR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            made = PrivacyEngine(accountant="rdp").make_private(
                module=m,
                optimizer=o,
                criterion=nn.CrossEntropyLoss(),
                data_loader=loader,
                noise_multiplier=SIGMA,
                max_grad_norm=CLIP,
                poisson_sampling=False,
                grad_sample_mode=mode,
            )
        if mode == "ghost":
            gm, go, crit, _ = made
        else:
            (gm, go, _), crit = made, nn.CrossEntropyLoss()

        def dp(gm=gm, go=go, crit=crit, mode=mode):
            go.zero_grad(set_to_none=True)
            logits = gm(x)
            # a sequence's logits flattened; opacus' ghost loss takes their shape to form each
            # example's loss (its documented use for generative models)
            shape = {"shape": logits.shape} if mode == "ghost" and logits.dim() == 3 else {}
            crit(logits.flatten(0, -2), y.flatten(), **shape).backward()
            go.step()

        out[f"opacus_{mode}"] = dp
    step = DpSgdStep(CLIP, SIGMA, n / DATASET, DATASET)
    for variant, source, replay in (
        ("privkit", DpRandom.secret(device), None),
        ("privkit_seeded", torch.Generator(device=device).manual_seed(0), None),
        ("privkit_replay", DpRandom.secret(device), StepReplay()),
        ("privkit_replay_seeded", torch.Generator(device=device).manual_seed(0), StepReplay()),
        (
            "privkit_replay_python_seeded",
            torch.Generator(device=device).manual_seed(0),
            StepReplay(script=False),
        ),
    ):
        m = copy.deepcopy(model)
        o = torch.optim.SGD(m.parameters(), lr=LR)

        def pk(m=m, o=o, source=source, replay=replay):
            step.apply(m, o, x, y, _per_example_loss, source, replay=replay)

        out[variant] = pk
    if torch_func:
        m = copy.deepcopy(model)
        o = torch.optim.SGD(m.parameters(), lr=LR)
        source = torch.Generator(device=device).manual_seed(0)

        def whole(m=m, o=o, source=source):
            with _torch_func_only():
                step.apply(m, o, x, y, _per_example_loss, source)

        out[TORCH_FUNC] = whole
    return out


def privkit_path(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> str:
    """``ghost_clipping`` (naming torch's layers it takes by ``torch.func`` on each alone), else
    the ``torch.func`` fallback and why."""
    try:
        ghost_clipping.per_example_norms(
            model,
            x[:2],
            lambda lo, s: (
                F.cross_entropy(lo.flatten(0, -2), y[:2][s].flatten(), reduction="none")
                .view(lo.shape[0], -1)
                .mean(1)
            ),
        )
    except UnsupportedModelError as e:
        return f"torch.func ({e})"
    alone = sorted(
        {type(layer.module).__name__ for layer in ghost_clipping._layers(model) if layer.vjp}
    )
    return f"ghost_clipping (torch.func on {', '.join(alone)} alone)" if alone else "ghost_clipping"


#: ``--host-bound``: records per step, and the images' and sequences' cropped size
HOST_BOUND_RECORDS, HOST_BOUND_SIZE = 4, 8


def _host_bound(name: str, x: torch.Tensor, y: torch.Tensor):
    """``--host-bound``'s batch: images cropped to 8x8 (the ViT's kept whole: its position
    embedding's length), sequences and their targets to 8 positions."""
    k = HOST_BOUND_SIZE
    if x.dim() == 5:  # volumes
        return x[:, :, :k, :k, :k].contiguous(), y
    if x.dim() == 4:
        return (x, y) if name.startswith("vit") else (x[:, :, :k, :k].contiguous(), y)
    return x[:, :k].contiguous(), (y[:, :k].contiguous() if y.dim() == 2 else y)


def measure(
    name: str,
    device: torch.device,
    repeats: int,
    host_bound: bool = False,
    autocast: bool = False,
    torch_func: bool = False,
) -> dict:
    if host_bound:
        from device_waits import gpu_forms  # this folder is on sys.path

        with gpu_forms():
            return _measure(name, device, repeats, host_bound, autocast, torch_func)
    return _measure(name, device, repeats, host_bound, autocast, torch_func)


def _autocast(fn, device: torch.device):
    """``fn`` run under bfloat16 autocast on ``device`` (``--autocast``)."""

    def run():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            fn()

    return run


def _measure(
    name: str,
    device: torch.device,
    repeats: int,
    host_bound: bool,
    autocast: bool,
    torch_func: bool = False,
) -> dict:
    torch.manual_seed(0)
    model, description, size = build(name)
    model = model.to(device)
    size = HOST_BOUND_RECORDS if host_bound else size
    x, y = batch(name, size, device)
    if host_bound:
        x, y = _host_bound(name, x, y)
    fns = steps(model, x, y, device, torch_func)
    if host_bound:  # its ChaCha20 stream is torch's operations here, one Triton kernel on a GPU
        del fns["privkit"], fns["privkit_replay"]
    if autocast:
        fns = {v: _autocast(fn, device) for v, fn in fns.items()}
    # one CPU thread: this process's CPU time, robust to other load; several threads or a GPU:
    # wall time (on a GPU between synchronisations)
    cpu_clock = device.type != "cuda" and torch.get_num_threads() == 1
    clock = time.process_time if cpu_clock else time.perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        start = clock()
        fn()
        sync()
        return clock() - start

    unavailable = {}
    # warm-up: allocations, kernel selection, opacus' first hooks, a replay's first step, its
    # trace and its checked first replay
    for v, fn in list(fns.items()):
        try:
            for _ in range(3):
                fn()
        except (NotImplementedError, RuntimeError, ValueError, OpacusRefusal) as e:
            # privkit's variants never refuse a model; opacus refuses some (its ghost clipping
            # tied weights, by NotImplementedError, a RuntimeError; its EmbeddingBag sampler an
            # input without offsets, by ValueError; a model it cannot set up: OpacusRefusal)
            # and may fail under autocast (a RuntimeError: half-precision per-example
            # gradients); torch.func's whole-model gradients fail where vmap cannot batch a
            # call (an RNN cell making its zero state in its call: the model privkit clipped by
            # torch.func before cells had their rule)
            refused = isinstance(e, (NotImplementedError, ValueError, OpacusRefusal))
            whole = v == TORCH_FUNC and isinstance(e, RuntimeError)
            if not whole and (not v.startswith("opacus") or not (refused or autocast)):
                raise
            unavailable[v] = f"{type(e).__name__}: {e}"[:300]
            del fns[v]
    variants = [v for v in (*VARIANTS, TORCH_FUNC) if v in fns]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            times[v].append(timed(fns[v]))
    med = {v: statistics.median(t) for v, t in times.items()}

    def ratio(v: str, ref: str) -> float:
        return statistics.median(a / b for a, b in zip(times[v], times[ref], strict=True))

    ghost = "opacus_ghost" in fns

    return {
        "model": description,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": size,
        "privkit_path": privkit_path(model, x, y),
        "median_ms": {v: 1e3 * t for v, t in med.items()},
        "vs_sgd": {v: ratio(v, "sgd") for v in variants},
        "vs_opacus_ghost": {v: ratio(v, "opacus_ghost") for v in variants} if ghost else {},
        "times_ms": {v: [1e3 * t for t in ts] for v, ts in times.items()},
        "unavailable": unavailable,
    }


#: the library a model needs besides torch and opacus
NEEDS = {"gpt2": "transformers", "gpt2_small": "transformers", "gpt2_small_lora": "peft"}


def _importable(module: str | None) -> bool:
    return module is None or importlib.util.find_spec(module) is not None


class _Stopped(Exception):
    """The run was asked to stop (SIGTERM: a time limit's ``timeout``)."""


def _measured(names: list[str], measure_one) -> tuple[dict, str | None]:
    """Each model's measurement in turn, a line on stderr after each; on SIGTERM (the time limit
    of a lent machine's stage) the models measured so far and why the run stopped, so that the
    JSON keeps them."""

    def stop(signum, _frame):
        raise _Stopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    results: dict = {}
    try:
        for name in names:
            begun = time.perf_counter()
            results[name] = measure_one(name)
            print(f"measured {name} in {time.perf_counter() - begun:.1f} s", file=sys.stderr)
    except _Stopped as e:
        left = [n for n in names if n not in results]
        return results, f"{e} after {len(results)} of {len(names)} models; not measured: " + (
            ", ".join(left)
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--big",
        action="store_true",
        help="add ResNet-18, a 6.9M encoder, a 7.1M ViT and GPT-2 small, whole and by LoRA (slow "
        "on a CPU)",
    )
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="keep freed memory in the process (privkit.memory.keep_freed_memory, as privkit's "
        "command line does): every variant's large tensors reuse freed pages",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on the CPU (more than one: wall time, not CPU time)",
    )
    ap.add_argument(
        "--host-bound",
        action="store_true",
        help="the host's work per step (CPU): 4 records, 8x8 images, 8 positions, privkit's GPU "
        "forms",
    )
    ap.add_argument(
        "--autocast",
        action="store_true",
        help="every variant's step under bfloat16 autocast (mixed precision)",
    )
    ap.add_argument(
        "--torch-func",
        action="store_true",
        help="add the seeded step clipped from the whole model's per-example gradients by "
        "torch.func (every example's gradient held: small models only)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; found {getattr(args, name)}")  # exit code 2
    device = torch.device(args.device)
    if args.host_bound and device.type != "cpu":
        ap.error(f"--host-bound measures the host's work on the CPU; found --device {args.device}")
    if args.threads > 1 and device.type != "cpu":
        ap.error(f"--threads sets the CPU's torch threads; found --device {args.device}")
    kept = keep_freed_memory() if args.keep_freed_memory else False
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # opacus' hooks
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.backends.cudnn.benchmark = False  # Poisson batch sizes vary in training
    big = ["resnet18", "encoder_large", "vit_large", "gpt2_small", "gpt2_small_lora"]
    big = big if args.big else []
    names = [
        "resnet_small",
        "resnet_small_bn",
        "resnet_small_ws",
        "transformer",
        "encoder",
        "vit",
        "lm",
        "gpt2",
        "lstm",
    ]
    names += ["encoder_seq_first", "lstm_torch", "lstm_cell", "lstm_packed", "lstm_stacked"]
    names += ["fasttext", "cnn3d"]
    names = big[:1] + names + big[1:]  # ResNet-18, the headline, first
    if args.models:
        names = args.models.split(",")
    # a model whose library is not installed (a GPU machine without transformers) is left out
    left_out = {n: f"{NEEDS[n]} is not installed" for n in names if not _importable(NEEDS.get(n))}
    start = time.perf_counter()
    results, stopped = _measured(
        [n for n in names if n not in left_out],
        lambda name: measure(
            name, device, args.repeats, args.host_bound, args.autocast, args.torch_func
        ),
    )
    import opacus

    res = {
        "schema_version": SCHEMA_VERSION,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "setup": {
            "clip_norm": CLIP,
            "noise_multiplier": SIGMA,
            "batch": (
                f"fixed, {HOST_BOUND_RECORDS} records, images cropped to {HOST_BOUND_SIZE}x"
                f"{HOST_BOUND_SIZE} and sequences to {HOST_BOUND_SIZE} positions (host-bound); "
                "privkit's GPU forms"
                if args.host_bound
                else "fixed, the expected Poisson batch size"
            )
            + "; the same examples for every variant",
            "host_bound": args.host_bound,
            "autocast": "bfloat16" if args.autocast else None,
            "torch_func": args.torch_func,
            "order": (
                "interleaved: each repeat runs every variant once, in turn; 3 warm-up steps (a "
                "replay's first step, its trace and its checked first replay among them)"
            ),
            "clock": (
                "CPU, one torch thread: this process's CPU time (robust to other processes' load "
                "on a shared machine); CPU, several threads: wall time; CUDA: wall time between "
                "synchronisations"
            ),
            "load_average": list(os.getloadavg()),
            "freed_memory_kept": kept,
        },
        "models": results,
        "left_out": left_out,
        "stopped": stopped,
        "wall_s": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for name, r in results.items():
        print(f"{name} ({r['parameters']} parameters, batch {r['batch']}, {r['privkit_path']}):")
        for v in r["median_ms"]:
            versus = r["vs_opacus_ghost"].get(v)
            print(
                f"  {v:15s} {r['median_ms'][v]:9.1f} ms  {r['vs_sgd'][v]:5.2f}x sgd"
                + (f"  {versus:5.2f}x opacus ghost" if versus is not None else "")
            )
        for v, why in r["unavailable"].items():
            print(f"  {v:15s} unavailable: {why}")
    for name, why in left_out.items():
        print(f"{name}: left out ({why})")
    if stopped:
        print(f"stopped: {stopped}")


if __name__ == "__main__":
    main()
