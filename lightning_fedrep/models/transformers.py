"""A Hugging Face sequence classifier as a LightningModule, optionally with LoRA adapters (``peft``).

Needs the ``transformers`` extra (``pip install "lightning-fedrep[transformers]"``: transformers and peft);
the rest of the package imports without it.

Batches are ``(input_ids, labels)``: ``input_ids`` an int64 ``(batch, length)`` tensor padded with
``pad_token_id``, ``labels`` int64 class ids. The attention mask is computed inside the module
(``input_ids != pad_token_id``), so a batch is the ``(x, y)`` pair every data module of this package
yields, the strategy's headline accuracy reads ``model(x)``, and the vectorized runner stacks nothing
but token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_fedrep.models.optim import weight_decay_groups

__all__ = ["EXTRA_HINT", "HFSequenceClassifier", "require_transformers"]

EXTRA_HINT = 'pip install "lightning-fedrep[transformers]"'
"""How to install what this module needs."""


def require_transformers(what: str, peft: bool = False) -> Any:
    """Import ``transformers`` (and ``peft`` when asked) or raise an ImportError naming the extra."""
    try:
        import transformers

        if peft:
            import peft as peft_module

            return peft_module
        return transformers
    except ImportError as error:
        raise ImportError(f"{what} needs transformers and peft: {EXTRA_HINT} ({error}).") from error


class HFSequenceClassifier(L.LightningModule):
    """``AutoModelForSequenceClassification`` for federated fine-tuning, with optional LoRA adapters.

    The model comes from ``model`` (a Hugging Face hub name or a local folder written by
    ``save_pretrained``, loaded with ``from_pretrained``; an encoder-only model such as BERT or a decoder-only one
    such as GPT-2) or from ``config`` (a dict of config fields with
    its ``model_type``, e.g. ``{"model_type": "bert", "hidden_size": 32, ...}``, built untrained with
    ``from_config``: offline tiny models for tests and smoke runs). Exactly one of them is given.

    With ``lora_r`` set, the model is wrapped by ``peft.get_peft_model`` with a ``LoraConfig`` of rank
    ``lora_r``, scaling ``lora_alpha``, ``lora_dropout`` and ``target_modules`` (``None``: peft's default
    for the architecture, the attention projections), task ``SEQ_CLS``: the base is frozen, the adapters
    and the classification layer (peft's ``modules_to_save``) train. Pass ``allow_frozen=True`` to the
    strategy, and choose what is personal with :func:`lightning_fedrep.models.lora.lora_split`.

    ``fedrep_loss = "cross_entropy"`` declares what ``training_step`` computes, so the vectorized runner
    takes the module: with dropout on under ``FederatedStrategy(randomness="per_client")`` (each client
    draws its own masks: the same distribution as the sequential runner, not the same draws), and under
    the default ``randomness="exact"`` only with ``dropout=0.0`` (the model's hidden, attention and
    classifier dropout, and LoRA's unless ``lora_dropout`` is given), computing what the sequential
    runner computes.

    The optimizer is AdamW (``optimizer="adamw"``, the usual choice for transformers and LoRA: their
    gradients are badly scaled across layers, and LoRA's B starts at zero) with ``weight_decay`` on weights
    only; ``optimizer="sgd"`` gives SGD with ``momentum`` (the vectorized runner's fastest optimizer).
    Only trainable parameters go into the optimizer (a frozen base holds no optimizer state).

    Args:
        model: hub name or local folder for ``from_pretrained``.
        config: config fields for ``from_config`` (with ``model_type``).
        num_labels: classes.
        pad_token_id: the padding id of ``input_ids`` (``None``: the config's; GPT-2 has none, then give it).
        dropout: when not ``None``, overrides the model's dropout probabilities (0.0 for the vectorized
            runner under ``randomness="exact"``; above 0 it needs ``randomness="per_client"``).
        lora_r, lora_alpha, lora_dropout, target_modules: the LoRA adapters (none when ``lora_r`` is None).
        optimizer, lr, weight_decay, momentum: the local optimizer.
        lora_split: a name of ``lightning_fedrep.models.lora.LORA_SPLITS`` whose personal part the module
            marks as its head (``fedrep_head``), for recipes (a YAML file cannot hold the regex ``head=``); the
            strategy still needs the split's ``algorithm`` and ``allow_frozen=True``.
        attn_implementation: Hugging Face's attention kernel (``"eager"``, ``"sdpa"``; ``None``: its default).
            ``"eager"`` batches natively under the vectorized runner; ``"sdpa"`` may fall back to a loop on CPU.
    """

    fedrep_loss = "cross_entropy"
    """What ``training_step`` computes: cross-entropy of ``self(input_ids)`` against the labels."""

    fedrep_evaluation = "headline"
    """``validation_step``/``test_step`` log nothing beyond the strategy's headline metrics."""

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        num_labels: int = 2,
        pad_token_id: int | None = None,
        dropout: float | None = None,
        lora_r: int | None = None,
        lora_alpha: float = 16.0,
        lora_dropout: float | None = None,
        target_modules: Sequence[str] | None = None,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        attn_implementation: str | None = None,
        lora_split: str | None = None,
    ):
        super().__init__()
        _check_arguments(model, config, num_labels, dropout, lora_r, lora_dropout, optimizer, lr)
        if lora_split is not None:
            self.fedrep_head = _split_head(lora_split, lora_r)
        self.save_hyperparameters()
        transformers = require_transformers("HFSequenceClassifier")
        hf_config = _build_config(transformers, model, config, num_labels, pad_token_id, dropout)
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ValueError(
                f"HFSequenceClassifier takes encoder-only (BERT) or decoder-only (GPT-2) models; "
                f"{hf_config.model_type!r} is an encoder-decoder model, whose attention mask this module "
                "cannot build. Choose an encoder-only or decoder-only checkpoint."
            )
        if hf_config.pad_token_id is None:
            raise ValueError(
                "HFSequenceClassifier: the model's config has no pad_token_id (GPT-2's has none); pass "
                "pad_token_id=<the id your data pads with>, e.g. the tokenizer's eos id."
            )
        self.pad_token_id = int(hf_config.pad_token_id)
        auto = transformers.AutoModelForSequenceClassification
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        net = (
            auto.from_pretrained(model, config=hf_config, **extra)
            if model
            else auto.from_config(hf_config, **extra)
        )
        if lora_r is not None:
            net = _with_lora(
                net, lora_r, lora_alpha, dropout if lora_dropout is None else lora_dropout, target_modules
            )
        self.net = net
        self.causal = _is_causal(net, hf_config)

    def setup(self, stage: str) -> None:
        """Refuse a data module that pads with another id (padding would be attended, silently)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        pad = getattr(datamodule, "pad_token_id", None)
        if isinstance(pad, int) and pad != self.pad_token_id:
            raise ValueError(
                f"The data module pads input_ids with {pad} but HFSequenceClassifier masks {self.pad_token_id}; "
                f"pass HFSequenceClassifier(pad_token_id={pad}) or a data module of this model's tokenizer."
            )

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``(batch, num_labels)`` of token ids ``(batch, length)``; padding is masked out."""
        mask = attention_bias(input_ids, self.pad_token_id, self.causal, self._mask_dtype())
        return self.net(input_ids=input_ids, attention_mask=mask).logits

    def _mask_dtype(self) -> torch.dtype:
        return next(p for p in self.net.parameters() if p.is_floating_point()).dtype

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, labels = batch
        loss = F.cross_entropy(self(input_ids), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        pass  # the strategy logs val/acc and val/loss per client from self(input_ids)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        pass  # the strategy logs test/acc and test/loss per client from self(input_ids)

    def predict_step(self, batch: tuple[Tensor, ...] | Tensor, batch_idx: int) -> Tensor:
        """The predicted class of each sequence (``input_ids`` or the first item of a batch)."""
        input_ids = batch[0] if isinstance(batch, tuple | list) else batch
        return self(input_ids).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW (or SGD with momentum) over the trainable parameters, weight decay on weights only."""
        hp = self.hparams
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        groups = weight_decay_groups(trainable, hp.weight_decay)
        if hp.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=hp.lr, momentum=hp.momentum)
        return torch.optim.AdamW(groups, lr=hp.lr)

    @property
    def peft_model(self) -> nn.Module:
        """The ``peft.PeftModel`` inside (for :func:`~lightning_fedrep.models.lora.save_peft_adapter`)."""
        if not hasattr(self.net, "peft_config"):
            raise ValueError("This HFSequenceClassifier has no LoRA adapters (build it with lora_r=<rank>).")
        return self.net


def attention_bias(input_ids: Tensor, pad_token_id: int, causal: bool, dtype: torch.dtype) -> Tensor:
    """The additive attention mask ``(batch, 1, length, length)`` of token ids ``input_ids`` ``(batch, length)``:
    0 where a query may attend a key, ``dtype``'s minimum where the key is padding (``pad_token_id``) or, when
    ``causal``, a later position.

    Hugging Face models take a 4D mask as given; from a 2D padding mask they would build this one after
    asking whether any token is padded (``mask.all()``), a data-dependent branch ``torch.func.vmap``
    cannot batch, so the vectorized runner could not take the module.
    """
    length = input_ids.shape[-1]
    allowed = (input_ids != pad_token_id)[..., None, None, :]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    return torch.zeros((), dtype=dtype, device=input_ids.device).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.no_grad()
def _is_causal(net: nn.Module, hf_config: Any) -> bool:
    """Whether the model's attention is causal (GPT-2) or bidirectional (BERT), measured once: a causal
    model's first position does not see a change of the last token. The probe runs in eval mode."""
    training = net.training
    net.eval()
    ids = torch.full((2, 3), 1 if hf_config.pad_token_id != 1 else 2, dtype=torch.long)
    ids[1, -1] = ids[0, -1] + 1
    try:
        device = next(net.parameters()).device
        states = net(input_ids=ids.to(device), output_hidden_states=True).hidden_states[-1]
    finally:
        net.train(training)
    return bool(torch.allclose(states[0, 0], states[1, 0]))


def _split_head(name: str, lora_r: int | None) -> Any:
    """The head regex of the LoRA split ``name`` (``None`` for ``"local"``, which needs no head)."""
    from lightning_fedrep.models.lora import lora_split

    if lora_r is None:
        raise ValueError(
            f"HFSequenceClassifier(lora_split={name!r}) needs LoRA adapters: pass lora_r=<rank> too."
        )
    return lora_split(name).head


def _check_arguments(
    model: str | None,
    config: dict[str, Any] | None,
    num_labels: int,
    dropout: float | None,
    lora_r: int | None,
    lora_dropout: float | None,
    optimizer: str,
    lr: float,
) -> None:
    """Refuse bad arguments before anything is built or downloaded."""
    if (model is None) == (config is None):
        raise ValueError(
            "HFSequenceClassifier needs exactly one of model=<hub name or local folder> (from_pretrained) "
            f"and config=<dict with model_type> (from_config); got model={model!r}, config={config!r}."
        )
    if config is not None and (not isinstance(config, dict) or "model_type" not in config):
        raise ValueError(
            f"HFSequenceClassifier(config=...) must be a dict with a 'model_type' (e.g. 'bert'), got {config!r}."
        )
    if not isinstance(num_labels, int) or num_labels < 2:
        raise ValueError(f"HFSequenceClassifier(num_labels=...) must be an int >= 2, got {num_labels!r}.")
    for name, value in (("dropout", dropout), ("lora_dropout", lora_dropout)):
        if value is not None and not 0.0 <= value < 1.0:
            raise ValueError(f"HFSequenceClassifier({name}=...) must be in [0, 1) or None, got {value!r}.")
    if lora_r is not None and (not isinstance(lora_r, int) or lora_r < 1):
        raise ValueError(f"HFSequenceClassifier(lora_r=...) must be a positive int or None, got {lora_r!r}.")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"HFSequenceClassifier(optimizer=...) must be 'adamw' or 'sgd', got {optimizer!r}.")
    if not lr > 0:
        raise ValueError(f"HFSequenceClassifier(lr=...) must be positive, got {lr!r}.")


DROPOUT_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "dropout",
    "attention_dropout",
    "seq_classif_dropout",
)
"""Config fields holding a dropout probability in the common architectures (BERT, GPT-2, DistilBERT, ...)."""


def _build_config(
    transformers: Any,
    model: str | None,
    config: dict[str, Any] | None,
    num_labels: int,
    pad_token_id: int | None,
    dropout: float | None,
) -> Any:
    """The Hugging Face config: the checkpoint's or one built from ``config``, with labels, padding, dropout."""
    if model is not None:
        hf_config = transformers.AutoConfig.from_pretrained(model)
    else:
        fields = dict(config)
        hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf_config.num_labels = num_labels
    if pad_token_id is not None:
        hf_config.pad_token_id = pad_token_id
    if dropout is not None:
        for field in DROPOUT_FIELDS:
            if hasattr(hf_config, field):
                setattr(hf_config, field, dropout)
    return hf_config


def _with_lora(
    net: nn.Module, r: int, alpha: float, dropout: float | None, target_modules: Sequence[str] | None
) -> nn.Module:
    """``net`` wrapped with LoRA adapters (its base frozen, the classifier in ``modules_to_save``)."""
    peft = require_transformers("HFSequenceClassifier(lora_r=...)", peft=True)
    lora = peft.LoraConfig(
        task_type=peft.TaskType.SEQ_CLS,
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0 if dropout is None else dropout,
        target_modules=list(target_modules) if target_modules is not None else None,
    )
    return peft.get_peft_model(net, lora)
