"""Writes the transformer recipes: LoRA adapters as the personal part (issue 42), none of them a paper setting.

    python recipes/generate.py          # rewrites every recipe, these included
    python recipes/generate.py --check  # exit 1 if a recipe differs from its table

* ``tiny_bert_lora_fedrep.yaml``: offline, a tiny BERT built from a config (untrained, nothing downloaded) on
  synthetic keyword sequences whose labels are rotated per client group (``PermutedLabelTextDataModule``);
  FedRep on the adapters. Seconds on a CPU; smoke-run by the tests.
* ``sent140_bert_tiny_lora_<split>.yaml``: a pretrained BERT (``prajjwal1/bert-tiny``, 4.4M parameters) on
  LEAF's Sent140 (the FedRep paper's 183 users), tokenized with the checkpoint's tokenizer, one recipe per
  split of :data:`lightning_fedrep.models.lora.LORA_SPLITS` plus LoRA-FedAvg (FlowerTune's baseline). Runnable
  where the weights are (the hub's cache, or a local folder: ``--model.init_args.model <folder>
  --data.init_args.tokenizer <folder>``).

The offline recipe keeps dropout on (0.1 in the model and in LoRA, the realistic setting) and trains on the
vectorized runner with ``randomness: per_client`` (each client its own dropout masks: the same distribution as
the sequential runner, not the same draws). The Sent140 recipes switch dropout off (``dropout: 0.0``), so the
vectorized runner computes exactly what the sequential one does (docs/transformers.md, "Randomness").
"""

from __future__ import annotations

from dataclasses import dataclass

from writer import render, trainer_section  # recipes/, put on sys.path by recipes/generate.py

FACTS: dict[str, tuple[str, str, str]] = {}
"""Per recipe path: what it runs, the logged figure to read, the paper's number (none: not paper settings)."""

TINY_BERT = {
    "model_type": "bert",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 32,
}
"""The offline recipe's model: a 2-layer BERT of width 32 over the synthetic 64-word vocabulary."""

PRETRAINED = "prajjwal1/bert-tiny"
"""The real recipes' checkpoint (2 layers, width 128; its tokenizer is bert-base-uncased's WordPiece)."""


@dataclass(frozen=True)
class Split:
    """A recipe's personal part: the strategy's settings and one sentence for the header."""

    algorithm: str
    lora_split: str | None  # the model's lora_split (its fedrep_head); None: LoRA-FedAvg, nothing personal
    epochs: dict
    text: str


SPLITS = {
    "fedsa": Split(
        "fedper",
        "fedsa",
        {"local_epochs": 5},
        "FedSA-LoRA: each client's B matrices and classifier are personal, the A matrices averaged; all train\n"
        "together for 5 local epochs (FedPer's schedule).",
    ),
    "adapters": Split(
        "fedper",
        "adapters",
        {"local_epochs": 5},
        "personal adapters (A and B), the classifier averaged; both train together for 5 local epochs.",
    ),
    "local": Split(
        "local",
        "local",
        {"local_epochs": 5, "client_optimizer_state": "keep"},
        "fully local adapters and classifier: nothing is shared, each client fine-tunes its own (Local Only),\n"
        "keeping its AdamW state from one round it is picked to the next (as training alone).",
    ),
    "fedrep": Split(
        "fedrep",
        "fedrep",
        {"head_epochs": 10, "body_epochs": 5},
        "FedRep on the adapters: each client's classifier is personal and trains first (10 epochs, adapters\n"
        "fixed), then the shared adapters (5 epochs, classifier fixed), the FedRep paper's Sent140 schedule.",
    ),
    "fedavg": Split(
        "fedavg",
        None,
        {"local_epochs": 5},
        "LoRA-FedAvg (FlowerTune's baseline): adapters and classifier averaged, nothing personal.",
    ),
}


def _model(config: dict | None, split: Split, lr: float, r: int, dropout: float = 0.0) -> dict:
    """The ``model:`` section: HFSequenceClassifier with LoRA of rank ``r``; ``dropout`` in the model and LoRA."""
    args: dict = {"model": PRETRAINED} if config is None else {"config": config}
    args.update({"num_labels": 2, "dropout": dropout, "lora_r": r, "lora_alpha": 16.0, "lr": lr})
    if config is not None:
        args["attn_implementation"] = "eager"  # batched natively by the vectorized runner on a CPU
    if split.lora_split is not None:
        args["lora_split"] = split.lora_split
    return {"class_path": "lightning_fedrep.models.transformers.HFSequenceClassifier", "init_args": args}


def _strategy(split: Split, clients_per_round: float, **extra) -> dict:
    return {
        "algorithm": split.algorithm,
        "allow_frozen": True,
        "clients_per_round": clients_per_round,
        "seed": 0,
        **split.epochs,
        **extra,
    }


def tiny_recipe() -> tuple[str, str]:
    """The offline recipe: FedRep on a tiny BERT's adapters, synthetic permuted-label sequences."""
    path = "transformers/tiny_bert_lora_fedrep.yaml"
    split = Split("fedrep", "fedrep", {"head_epochs": 2, "body_epochs": 1}, "")
    rounds = 10
    trainer = trainer_section(
        "transformers",
        "tiny_bert_lora_fedrep",
        rounds,
        _strategy(split, 1.0, randomness="per_client"),
        accelerator="cpu",
    )
    data = {
        "class_path": "lightning_fedrep.data.synthetic_text.PermutedLabelTextDataModule",
        "init_args": {
            "num_clients": 20,
            "samples_per_client": 48,
            "test_samples_per_client": 32,
            "num_groups": 2,
            "length": 10,
            "keywords_per_sample": 3,
            "batch_size": 8,
            "seed": 0,
        },
    }
    recipe = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": _model(TINY_BERT, split, 1e-2, 4, dropout=0.1),
        "data": data,
    }
    header = (
        "Offline demo (not a paper setting): FedRep on LoRA adapters of a tiny BERT built from a config (2 layers,\n"
        "width 32, untrained, nothing downloaded), 20 clients of synthetic keyword sequences (PermutedLabelTextDataModule)\n"
        "whose labels are flipped in every other client (two groups), every client each round, 10 rounds.\n"
        "The base is frozen (allow_frozen: true); lora_split: fedrep makes the classifier (peft's modules_to_save)\n"
        "the personal head, trained 2 epochs with the adapters fixed, then the shared LoRA adapters 1 epoch.\n"
        "AdamW lr 0.01, LoRA rank 4 on query/value; dropout 0.1 in the model and in LoRA, trained on the vectorized\n"
        "runner with randomness: per_client (each client its own dropout masks: the same distribution as the\n"
        "sequential runner, not the same draws; reproducible for the seed).\n"
        "A global model cannot fit both groups (FedAvg stays near 50%); read val/acc of the last round (0.91 as\n"
        "written, in about 9 s on a shared 2-core CPU, imports included).\n"
        f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        "offline demo (not a paper setting): FedRep on a tiny BERT's LoRA adapters",
        "`val/acc` of the last round",
        "—",
    )
    return path, render(header, recipe)


def sent140_recipe(name: str) -> tuple[str, str]:
    """A pretrained BERT-tiny with LoRA on Sent140 (183 users), personalized by the split ``name``."""
    split = SPLITS[name]
    path = f"transformers/sent140_bert_tiny_lora_{name}.yaml"
    rounds = 50
    trainer = trainer_section("transformers", f"sent140_bert_tiny_lora_{name}", rounds, _strategy(split, 0.1))
    data = {
        "class_path": "lightning_fedrep.data.sent140.Sent140DataModule",
        "init_args": {
            "train_dir": "data/sent140/train",
            "test_dir": "data/sent140/test",
            "tokenizer": PRETRAINED,
            "max_words": 32,
            "max_clients": 183,
            "user_order": "file",
            "batch_size": 4,
            "seed": 0,
        },
    }
    recipe = {"seed_everything": 0, "trainer": trainer, "model": _model(None, split, 1e-3, 8), "data": data}
    header = (
        f"Not a paper setting: a pretrained BERT ({PRETRAINED}, 2 layers, width 128) with LoRA adapters (rank 8,\n"
        "alpha 16, query/value) on LEAF's Sent140, the FedRep paper's 183 users (preprocess.sh -s niid --sf 0.3 -k 50\n"
        "-tf 0.8 -t sample, the first 183 users in file order), r=0.1, T=50 rounds, batch 4, AdamW lr 1e-3.\n"
        f"Personal part: {split.text}\n"
        "The base is frozen (allow_frozen: true): neither trained, averaged nor stored per client.\n"
        "Tweets are tokenized with the checkpoint's tokenizer (tokenizer:, 32 tokens, padded); dropout 0.0 so the\n"
        "vectorized runner runs it exactly.\n"
        f"Weights: from the Hugging Face hub ({PRETRAINED}) or its cache; offline, point model and tokenizer at a\n"
        "folder written by save_pretrained: --model.init_args.model <folder> --data.init_args.tokenizer <folder>.\n"
        "For scale: the paper's FedRep with its LSTM on GloVe reaches 72.41% (val/acc_weighted_last10 of\n"
        "sent140/183_2_fedrep.yaml); read val/acc_weighted_last10.\n"
        f"Run: lightning-fedrep fit --config recipes/{path}"
    )
    FACTS[path] = (
        f"not a paper setting: BERT-tiny LoRA on Sent140 (183 users), {name} split",
        "`val/acc_weighted_last10`",
        "—",
    )
    return path, render(header, recipe)


def all_recipes() -> dict[str, str]:
    """Every transformer recipe, keyed by its path under ``recipes/``."""
    recipes = dict([tiny_recipe()])
    recipes.update(sent140_recipe(name) for name in SPLITS)
    return recipes
