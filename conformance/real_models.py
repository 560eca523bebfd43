"""A zoo of real architectures: tiny ``transformers`` models of the shapes that break sharded state dicts.

Each :class:`RealModel` builds a randomly initialised model from a tiny config (on the CPU, no
network), names the block classes that become sharding units, makes the global batch of each
training step, and computes the loss the model trains on. The tests (``conformance/test_real_models.py``)
run each one through the suite's oracle: the unwrapped model trained on the whole batch on one process.

=============  ===============================================================================
name           what it exercises
=============  ===============================================================================
gpt2           ``lm_head`` tied to ``transformer.wte`` (both keys in the state dict), Conv1D weights
llama          untied head; rotary ``inv_freq`` non-persistent buffers; grouped-query attention
llama-tied     the same with ``tie_word_embeddings=True``
bert           masked-LM head tied to the word embeddings, and its bias tied to the decoder's;
               non-persistent ``position_ids`` / ``token_type_ids`` buffers
t5             encoder and decoder share ``shared`` (four keys, one parameter); the relative position
               bias made by block 0 is passed to the later blocks and returned by them
mixtral        sparse mixture of experts (4 experts, top-2) whose experts are two 3-D parameters
               (transformers 5 fuses them): an expert without tokens is zero rows of a gradient
switch         SwitchTransformers (T5 with top-1 routing to 8 experts, one module each): an expert no
               token reaches has no gradient, on some ranks or on all of them
vit            patch embedding (Conv2d), ``cls_token`` and position embeddings as bare parameters
=============  ===============================================================================

Sizes are awkward where the config allows (hidden 18 or 30, vocabulary 61, feed-forward 37, sequence 7),
so shards are uneven at every world size. Dropout is off everywhere, attention and Mixtral's experts are
``eager`` (a loop over the experts that got tokens; not grouped matmuls), so
training is deterministic and identical across world sizes. Every batch has :data:`GLOBAL_BATCH` rows
and every loss is a mean over rows with the same number of tokens per row (no ``-100`` labels; Mixtral's
router auxiliary loss is off), so N ranks averaging the gradients of their equal slices
(:func:`rank_slice`) compute the gradient of the whole batch.

``transformers`` is optional (``pip install statedict-conformance[models]``): without it
:data:`REAL_MODELS` is still defined by name, and :data:`MISSING` says why nothing can be built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conformance import pattern_models as patterns

__all__ = [
    "GLOBAL_BATCH",
    "DTYPE",
    "MISSING",
    "REAL_MODELS",
    "RealModel",
    "transformers_missing",
    "rank_slice",
    "parameter_units",
    "give_flat_parameter_grads",
    "weight_decay_groups",
    "GROUP_HYPERPARAMETERS",
    "adamw",
    "train_step",
]

#: Rows of every global batch: world sizes 1, 2 and 4 split it evenly.
GLOBAL_BATCH = 4
VOCAB = 61
SEQ = 7
TARGET_SEQ = 5  #: T5's label length (its decoder input is the labels shifted right)
NUM_LABELS = 5  #: ViT's classes
IMAGE, PATCH, CHANNELS = 8, 4, 3

#: Parameter (and floating buffer) dtype of every model. Not float32: the sharded run sums gradients in
#: another order than the oracle, and Adam divides a gradient by its own magnitude, so a gradient that
#: cancels to about 1e-9 (an attention key bias: softmax ignores a shift shared by all keys; some query
#: weights) turns float32 rounding into a step that differs by 1e-5. In float64 that stays below 1e-10.
DTYPE = torch.float64

Inputs = dict[str, torch.Tensor]


def transformers_missing() -> str | None:
    """None if ``transformers`` imports, else the reason every real model is skipped."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return "transformers is not installed (pip install statedict-conformance[models])"
    return None


#: Why the real models cannot be built here, or None (checked once, at import).
MISSING: str | None = transformers_missing()


def _transformers() -> Any:
    # Imported by name: the module is optional, and mypy need not follow it into all of transformers.
    return importlib.import_module("transformers")


@dataclass(frozen=True)
class RealModel:
    """One architecture of the zoo."""

    #: the key in :data:`REAL_MODELS` and the test ids
    name: str
    #: a fresh model, random init from the tiny config (CPU): :meth:`build` calls it seeded
    make: Callable[[], nn.Module]
    #: the blocks that become sharding units, as ``module:Class`` of ``transformers`` (resolved lazily,
    #: by :attr:`unit_classes`, so that the zoo is defined without transformers)
    unit_class_names: tuple[str, ...]
    #: (step, global batch rows) -> the inputs of that training step, labels included
    batch: Callable[[int, int], Inputs]
    #: (model, inputs) -> the scalar it trains on: a mean over rows
    loss: Callable[[nn.Module, Inputs], torch.Tensor]
    #: groups of state-dict keys that name one parameter, as ``nn.Module.state_dict()`` lists them
    tied: tuple[tuple[str, ...], ...] = ()
    #: non-persistent buffers (in no state dict; a load must leave them alone)
    non_persistent: tuple[str, ...] = ()
    #: False for the plain-torch patterns of :mod:`conformance.pattern_models`, which build without it
    needs_transformers: bool = True

    @property
    def missing(self) -> str | None:
        """Why this model cannot be built here (``transformers`` absent), or None."""
        return MISSING if self.needs_transformers else None

    def build(self, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """The model in :data:`DTYPE`, its parameters depending only on ``seed`` (the global RNG is left
        as it was)."""
        if self.missing is not None:
            raise RuntimeError(f"cannot build real model {self.name!r}: {self.missing}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.make()
        return model.to(device=device, dtype=DTYPE)

    @property
    def unit_classes(self) -> tuple[type[nn.Module], ...]:
        """The block classes of :attr:`unit_class_names`, from ``transformers``."""
        return tuple(_find_class(name) for name in self.unit_class_names)

    def is_unit(self, module: nn.Module) -> bool:
        """A ``ShardingPlan.units`` predicate: ``module`` is one of the blocks."""
        return isinstance(module, self.unit_classes)


def _find_class(spec: str) -> type[nn.Module]:
    """A modeling class of ``transformers`` by ``module:Class`` (blocks are not exported at the top level)."""
    module_name, _, class_name = spec.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"real models: {spec!r} is not an nn.Module class")
    return cls


# -- builders: one tiny config each --------------------------------------------------------------------


def _hf(config_class: str, model_class: str, **config: Any) -> nn.Module:
    tf = _transformers()
    cfg = getattr(tf, config_class)(attn_implementation="eager", **config)
    return getattr(tf, model_class)(cfg)


def _gpt2() -> nn.Module:
    model: Any = _hf(
        "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=13, n_embd=18, n_layer=2, n_head=3, n_inner=37,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )
    # The loss transformers falls back to for a class name it does not recognise, named, so that it does
    # not warn on every rank.
    model.loss_type = "ForCausalLM"
    return model


def _llama(tied: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return _hf(
            "LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, hidden_size=18, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, head_dim=6, max_position_embeddings=13, attention_dropout=0.0,
            tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        )

    return build


def _bert() -> nn.Module:
    return _hf(
        "BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=18, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=37, max_position_embeddings=13, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )


def _t5() -> nn.Module:
    return _hf(
        "T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=30, d_kv=7, d_ff=37, num_layers=2,
        num_decoder_layers=2, num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


def _mixtral() -> nn.Module:
    return _hf(
        "MixtralConfig", "MixtralForCausalLM", vocab_size=VOCAB, hidden_size=18, intermediate_size=13, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=6, max_position_embeddings=13, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=False, experts_implementation="eager", router_jitter_noise=0.0, attention_dropout=0.0,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def _switch() -> nn.Module:
    # Every token goes to one expert (top-1); capacity is counted per sequence and is never reached, so
    # a rank's slice of rows routes as the whole batch does. No router losses: the loss is a plain mean.
    model: Any = _hf(
        "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", vocab_size=VOCAB, d_model=18, d_kv=6, d_ff=13,
        num_layers=2, num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=3, num_experts=8,
        expert_capacity=64, router_bias=False, router_jitter_noise=0.0, router_z_loss_coef=0.0, router_aux_loss_coef=0.0,
        output_router_logits=False, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    # The router casts its classifier to `router.dtype` on every forward (the config allows float32 and
    # narrower only): in a float64 model that would change a parameter's dtype inside a sharding unit.
    routers: list[Any] = [m for m in model.modules() if type(m).__name__ == "SwitchTransformersTop1Router"]
    for router in routers:
        router.dtype = DTYPE
    return model


def _vit() -> nn.Module:
    return _hf(
        "ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=18,
        num_hidden_layers=2, num_attention_heads=3, intermediate_size=37, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=NUM_LABELS, problem_type="single_label_classification",
    )


# -- batches and losses ----------------------------------------------------------------------------------


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_000 + step)


def _causal_lm_batch(step: int, rows: int) -> Inputs:
    """Token ids; the labels are the ids (the model shifts them: every row has ``SEQ - 1`` targets)."""
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=_generator(step))
    return {"input_ids": ids, "labels": ids.clone()}


def _masked_lm_batch(step: int, rows: int) -> Inputs:
    """Token ids and a label at every position (none ignored, so every row counts ``SEQ`` tokens)."""
    gen = _generator(step)
    return {"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (rows, SEQ), generator=gen)}


def _seq2seq_batch(step: int, rows: int) -> Inputs:
    gen = _generator(step)
    return {
        "input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=gen),
        "labels": torch.randint(0, VOCAB, (rows, TARGET_SEQ), generator=gen),
    }


def _image_batch(step: int, rows: int) -> Inputs:
    gen = _generator(step)
    return {
        "pixel_values": torch.randn(rows, CHANNELS, IMAGE, IMAGE, generator=gen, dtype=DTYPE),
        "labels": torch.randint(0, NUM_LABELS, (rows,), generator=gen),
    }


def _own_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """The model's own loss with the labels: cross entropy, a mean over the batch's (equally many per
    row) targets."""
    loss: torch.Tensor = model(**inputs).loss
    return loss


def rank_slice(inputs: Mapping[str, torch.Tensor], rank: int, world_size: int) -> Inputs:
    """Rank ``rank``'s equal share of a global batch: ``x.chunk(world_size)[rank]`` of every tensor."""
    rows = {v.shape[0] for v in inputs.values()}
    if len(rows) != 1 or next(iter(rows)) % world_size:
        raise ValueError(f"rank_slice: a batch of {sorted(rows)} rows does not split evenly over {world_size} ranks")
    return {k: v.chunk(world_size)[rank] for k, v in inputs.items()}


def _block(family: str, name: str) -> str:
    return f"transformers.models.{family}.modeling_{family}:{name}"


def _pattern(name: str) -> str:
    return f"conformance.pattern_models:{name}"


def _pattern_batch(step: int, rows: int) -> Inputs:
    return {k: v.to(DTYPE) if v.is_floating_point() else v for k, v in patterns.batch(step, rows).items()}


def _routed_batch(step: int, rows: int) -> Inputs:
    return {k: v.to(DTYPE) if v.is_floating_point() else v for k, v in patterns.batch(step, rows, routed=True).items()}


def _on(inputs: Inputs, device: torch.device | str) -> Inputs:
    return {k: v.to(device) for k, v in inputs.items()}


REAL_MODELS: dict[str, RealModel] = {
    model.name: model
    for model in (
        RealModel("gpt2", _gpt2, (_block("gpt2", "GPT2Block"),), _causal_lm_batch, _own_loss, tied=(("transformer.wte.weight", "lm_head.weight"),)),
        RealModel(
            "llama", _llama(False), (_block("llama", "LlamaDecoderLayer"),), _causal_lm_batch, _own_loss,
            non_persistent=("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"),
        ),
        RealModel(
            "llama-tied", _llama(True), (_block("llama", "LlamaDecoderLayer"),), _causal_lm_batch, _own_loss,
            tied=(("model.embed_tokens.weight", "lm_head.weight"),),
            non_persistent=("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"),
        ),
        RealModel(
            "bert", _bert, (_block("bert", "BertLayer"),), _masked_lm_batch, _own_loss,
            tied=(("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"), ("cls.predictions.bias", "cls.predictions.decoder.bias")),
            non_persistent=("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"),
        ),
        RealModel(
            "t5", _t5, (_block("t5", "T5Block"),), _seq2seq_batch, _own_loss,
            tied=(("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"),),
        ),
        RealModel(
            "mixtral", _mixtral, (_block("mixtral", "MixtralDecoderLayer"),), _causal_lm_batch, _own_loss,
            non_persistent=("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"),
        ),
        RealModel(
            "switch", _switch, (_block("switch_transformers", "SwitchTransformersBlock"),), _seq2seq_batch, _own_loss,
            tied=(("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"),),
        ),
        RealModel("vit", _vit, (_block("vit", "ViTLayer"),), _image_batch, _own_loss),
        # The patterns behind them, in plain torch (conformance/pattern_models.py): no transformers needed.
        RealModel(
            "passthrough", patterns.PassThrough, (_pattern("PassFirst"), _pattern("PassBlock")), _pattern_batch, patterns.loss,
            non_persistent=tuple(f"blocks.{i}.shift" for i in range(3)), needs_transformers=False,
        ),
        RealModel(
            "shared", patterns.Shared, (_pattern("SharedBlock"),), _pattern_batch, patterns.loss,
            tied=(("embed.weight", "encoder_embed.weight", "decoder_embed.weight"), ("embed.bias", "encoder_embed.bias", "decoder_embed.bias")),
            needs_transformers=False,
        ),
        RealModel("reused", patterns.Reused, (_pattern("ReusedBlock"),), _pattern_batch, patterns.loss, needs_transformers=False),
        RealModel("routed", patterns.Routed, (_pattern("MoELayer"),), _routed_batch, patterns.loss, needs_transformers=False),
    )
}


# -- training, and the oracle of flat parameters -------------------------------------------------------------


def parameter_units(model: nn.Module, unit_classes: tuple[type[nn.Module], ...]) -> dict[str, str]:
    """Every parameter (by its first FQN, ``named_parameters`` order) -> its sharding unit: the path of
    the innermost module of ``unit_classes`` that registers it or contains the module that does, or
    ``""`` for the root unit (everything outside the blocks). Paths are those of ``model`` as given."""
    unit_of: dict[str, str] = {}
    for path, module in model.named_modules():  # parents before their children
        inherited = unit_of[path.rpartition(".")[0]] if path else ""
        unit_of[path] = path if path and isinstance(module, unit_classes) else inherited
    return {fqn: unit_of[fqn.rpartition(".")[0]] for fqn, _ in model.named_parameters()}


def give_flat_parameter_grads(model: nn.Module, unit_classes: tuple[type[nn.Module], ...]) -> list[str]:
    """The flat-parameter oracle: make the unwrapped ``model`` step as a model sharded with
    ``use_orig_params=False`` does. Call after ``backward()``, before ``optimizer.step()``.

    Why: with flat parameters each unit's parameters are one tensor, and its gradient is one tensor too.
    A parameter that took no part in the loss (a Mixtral expert no token was routed to) is then a
    stretch of zeros in a gradient that exists, not a missing gradient: the optimizer steps it (AdamW's
    weight decay moves it, its Adam state is created). Unwrapped, its ``grad`` is None and the
    optimizer skips it. So every trainable parameter whose ``grad`` is None but whose unit
    (:func:`parameter_units`) holds a parameter with a gradient gets ``torch.zeros_like(p)``; a unit
    none of whose parameters has a gradient stays untouched (its flat parameter has none either).
    With ``use_orig_params=True`` this does not apply: a parameter used on no rank keeps ``None``.

    Returns the FQNs given zeros, in ``named_parameters`` order."""
    units = parameter_units(model, unit_classes)
    params = dict(model.named_parameters())
    stepped = {units[fqn] for fqn, p in params.items() if p.grad is not None}
    filled = []
    for fqn, param in params.items():
        if param.requires_grad and param.grad is None and units[fqn] in stepped:
            param.grad = torch.zeros_like(param)
            filled.append(fqn)
    return filled


def weight_decay_groups(
    model: nn.Module, unit_classes: tuple[type[nn.Module], ...], *, by_unit: bool
) -> dict[str, bool]:
    """Trainable parameter FQN (first name) -> whether its param group has weight decay.

    As real trainers do: decay on parameters of two dimensions or more, none on the rest (norms,
    biases). ``by_unit``: for a layout with flat parameters somewhere (a flat parameter is 1-D and holds
    a whole unit, so one param group must take whole units): decay on the blocks' units, none on the
    root unit (embeddings, final norm, head)."""
    if by_unit:
        units = parameter_units(model, unit_classes)
        return {fqn: units[fqn] != "" for fqn, p in model.named_parameters() if p.requires_grad}
    return {fqn: p.dim() >= 2 for fqn, p in model.named_parameters() if p.requires_grad}


#: The two groups' hyperparameters (decay, no decay), with the keys an LR scheduler and a user add.
GROUP_HYPERPARAMETERS: tuple[dict[str, Any], dict[str, Any]] = (
    {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "initial_lr": 0.02, "sdc_custom": "decay"},
    {"lr": 0.005, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0, "initial_lr": 0.01, "sdc_custom": "no-decay"},
)


def adamw(named: Iterable[tuple[tuple[str, ...], nn.Parameter]], decay: Mapping[str, bool]) -> torch.optim.AdamW:
    """AdamW over ``named`` ((FQNs a parameter stands for, parameter): a flat parameter stands for
    several), in two groups by ``decay`` (:func:`weight_decay_groups`); frozen parameters left out.
    Raises ValueError for a parameter whose FQNs fall in both groups."""
    groups: list[list[nn.Parameter]] = [[], []]
    for fqns, param in named:
        if not param.requires_grad:
            continue
        homes = {decay[f] for f in fqns if f in decay}
        if len(homes) != 1:
            raise ValueError(f"adamw: parameter {list(fqns)} falls in {len(homes)} weight-decay groups; expected exactly one")
        groups[0 if homes.pop() else 1].append(param)
    return torch.optim.AdamW([{"params": ps, **dict(h)} for ps, h in zip(groups, GROUP_HYPERPARAMETERS) if ps])


def train_step(
    real: RealModel,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    inputs: Inputs,
    *,
    flat_units: tuple[type[nn.Module], ...] | None = None,
) -> torch.Tensor:
    """One step of ``real.loss`` on ``inputs`` (moved to the model's device); ``flat_units``: step as
    a flat-parameter layout with those unit classes would (:func:`give_flat_parameter_grads`).
    Returns the detached loss."""
    device = next(model.parameters()).device
    optim.zero_grad(set_to_none=True)
    loss = real.loss(model, _on(inputs, device))
    loss.backward()
    if flat_units is not None:
        give_flat_parameter_grads(model, flat_units)
    optim.step()
    return loss.detach()
