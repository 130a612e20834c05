"""The transformer recipes (recipes/transformers, issue 42) run through the command: the offline tiny-BERT recipe
as written, the Sent140 ones on a tiny BERT saved with ``save_pretrained`` in the pretrained checkpoint's place
(model and tokenizer from a local folder, LEAF files in the real format; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lightning_fedrep.app.cli import build_cli  # noqa: E402
from lightning_fedrep.models.lora import LORA_SPLITS  # noqa: E402
from tests.test_sent140 import write_sent140  # noqa: E402
from tests.test_transformers_lora import write_tiny_tokenizer  # noqa: E402

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SENT140 = sorted(p.name for p in (RECIPES / "transformers").glob("sent140_*.yaml"))


def test_tiny_recipe_smoke_runs_vectorized_with_dropout_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "fit",
            "--config",
            str(RECIPES / "transformers" / "tiny_bert_lora_fedrep.yaml"),
            "--trainer.fast_dev_run=true",
        ]
    )
    strategy = cli.trainer.strategy
    assert cli.trainer.global_step >= 1
    assert strategy.runner_report.runner == "vectorized"
    assert strategy.runner_report.randomness_contract.startswith(
        "per_client:"
    )  # dropout on, per-client masks
    assert (
        cli.model.net.config.hidden_dropout_prob > 0 and cli.model.net.peft_config["default"].lora_dropout > 0
    )
    assert set(strategy.federation.local_names) == set(LORA_SPLITS["fedrep"].personal(cli.model))


@pytest.fixture(scope="module")
def pretrained_folder(tmp_path_factory):
    """A tiny BERT and a WordPiece tokenizer written by ``save_pretrained``, standing in for prajjwal1/bert-tiny."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    folder = tmp_path_factory.mktemp("bert-tiny")
    tokenizer = BertTokenizer.from_pretrained(write_tiny_tokenizer(folder / "tokenizer", BertTokenizer))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=64,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("recipe", SENT140)
def test_sent140_recipe_smoke_on_a_local_checkpoint(recipe, pretrained_folder, tmp_path, monkeypatch):
    train, test = write_sent140(tmp_path / "sent140", {f"u{u}": (5 + u % 3, 2) for u in range(12)})
    monkeypatch.chdir(tmp_path)
    path = RECIPES / "transformers" / recipe
    cli = build_cli(
        [
            "fit",
            "--config",
            str(path),
            "--trainer.fast_dev_run=true",
            "--trainer.accelerator=cpu",
            f"--model.init_args.model={pretrained_folder}",
            f"--data.init_args.tokenizer={pretrained_folder}",
            f"--data.init_args.train_dir={train}",
            f"--data.init_args.test_dir={test}",
        ]
    )
    assert cli.trainer.global_step >= 1
    spec = yaml.safe_load(path.read_text())
    assert cli.trainer.strategy.algorithm.name == spec["trainer"]["strategy"]["init_args"]["algorithm"]
    frozen = {n for n, p in cli.model.named_parameters() if not p.requires_grad}
    federation = cli.trainer.strategy.federation
    assert frozen and not frozen & (set(federation.local_names) | set(federation.shared_names))
    split = spec["model"]["init_args"].get("lora_split")
    expected = set(LORA_SPLITS[split].personal(cli.model)) if split else set()
    assert set(federation.local_names) == expected
