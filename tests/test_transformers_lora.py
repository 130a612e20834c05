"""Transformers with LoRA adapters as the personal part (issue 42): a tiny BERT and a tiny GPT-2 built from
configs (nothing downloaded). The vectorized runner equals the sequential one with dropout off; the FedSA
split stores only the adapters and classifier per client (measured from the store and the checkpoint); a
client's exported adapter loads into ``PeftModel`` and predicts what the strategy predicts; personal labels
are learnt by personal adapters and not by FedAvg. With dropout on (model and LoRA) under
``randomness="per_client"`` the vectorized runner runs, is bit-identical for a seed and after a resume, and
matches the sequential runner's accuracy over seeds."""

from __future__ import annotations

import json
import math
import statistics

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_fedrep import CHECKPOINT_KEY, FederatedStrategy  # noqa: E402
from lightning_fedrep.data.synthetic_text import (  # noqa: E402
    PAD_ID,
    PermutedLabelTextDataModule,
    make_permuted_label_text,
)
from lightning_fedrep.models.lora import LORA_SPLITS, lora_split, save_peft_adapter  # noqa: E402
from lightning_fedrep.models.transformers import HFSequenceClassifier, attention_bias  # noqa: E402
from tests.fixtures import quiet_trainer  # noqa: E402

BERT = dict(
    model_type="bert",
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
)
GPT2 = dict(
    model_type="gpt2",
    vocab_size=64,
    n_embd=16,
    n_layer=2,
    n_head=2,
    n_positions=32,
    bos_token_id=1,
    eos_token_id=1,
)
CONFIGS = {"bert": BERT, "gpt2": GPT2}


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors of width 16 gain nothing from intra-op threads, and on a shared CPU the threads' spin-waits
    cost up to 50x (a fit of 0.3 s took 26 s with 2 threads on 2 busy cores): every test here runs on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(kind: str = "bert", lora: bool = True, **kwargs) -> HFSequenceClassifier:
    torch.manual_seed(0)
    defaults = dict(
        config=CONFIGS[kind], dropout=0.0, lr=1e-2, pad_token_id=PAD_ID, attn_implementation="eager"
    )
    if lora:
        defaults["lora_r"] = 4
    return HFSequenceClassifier(**{**defaults, **kwargs})


def text_data(num_clients: int = 6, samples: int = 12, **kwargs) -> PermutedLabelTextDataModule:
    defaults = dict(
        num_clients=num_clients,
        samples_per_client=samples,
        test_samples_per_client=8,
        length=10,
        batch_size=4,
    )
    return PermutedLabelTextDataModule(**{**defaults, **kwargs})


def fit(runner, split="fedsa", kind="bert", rounds=2, data=None, model=None, trainer=None, **kwargs):
    model = model or tiny_model(kind)
    settings = dict(lora_split(split, model).strategy_kwargs(), clients_per_round=4, seed=1)
    settings.update(head_epochs=1, body_epochs=1) if settings["algorithm"] == "fedrep" else None
    settings.update(local_epochs=1) if settings["algorithm"] != "fedrep" else None
    settings.update(kwargs)
    strategy = FederatedStrategy(runner=runner, **settings)
    trainer = trainer or quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(model, datamodule=data or text_data())
    return strategy, model


def assert_same(a, b):
    for name, value in a.global_tensors().items():
        torch.testing.assert_close(b.global_tensors()[name], value, msg=name)
    for client in range(a.num_clients):
        for name, value in a.client_tensors(client).items():
            torch.testing.assert_close(b.client_tensors(client)[name], value, msg=f"{client} {name}")


def adapter_bytes(model, split) -> int:
    """Bytes of the split's personal parameters of ``model``, from the module (the reference)."""
    named = dict(model.named_parameters())
    return sum(named[n].nbytes for n in LORA_SPLITS[split].personal(model))


# ----------------------------------------------------------------------------- the module


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_attention_bias_equals_the_models_own_padding_mask(kind):
    model = tiny_model(kind).eval()
    ids = torch.randint(1, 64, (3, 9))
    ids[0, 5:] = PAD_ID
    ids[2, 7:] = PAD_ID
    reference = model.net(input_ids=ids, attention_mask=(ids != PAD_ID).long()).logits
    torch.testing.assert_close(model(ids), reference)
    assert model.causal == (kind == "gpt2")


def test_attention_bias_closed_form():
    ids = torch.tensor([[5, 6, 0]])
    bias = attention_bias(ids, 0, causal=True, dtype=torch.float32)
    low = torch.finfo(torch.float32).min
    expected = torch.tensor([[0.0, low, low], [0.0, 0.0, low], [0.0, 0.0, low]])
    torch.testing.assert_close(bias[0, 0], expected)


def test_lora_freezes_the_base_and_trains_adapters_and_classifier():
    model = tiny_model("bert")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("lora_" in n) or ("modules_to_save" in n) for n in trainable)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(), "exactly one of model="),
        (dict(config=BERT, model="x"), "exactly one of model="),
        (dict(config={"hidden_size": 4}), "model_type"),
        (dict(config=BERT, num_labels=1), "num_labels"),
        (dict(config=BERT, dropout=1.5), "dropout"),
        (dict(config=BERT, lora_r=0), "lora_r"),
        (dict(config=BERT, optimizer="adam"), "optimizer"),
        (dict(config=BERT, lr=0.0), "lr"),
        (dict(config={**GPT2, "pad_token_id": None}), "pad_token_id"),
        (dict(config={"model_type": "bart", "d_model": 8, "vocab_size": 16}), "encoder-decoder"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HFSequenceClassifier(**kwargs)


def test_the_module_can_mark_a_splits_personal_part_as_its_head():
    model = tiny_model("bert", lora_split="fedsa")
    assert model.fedrep_head is LORA_SPLITS["fedsa"].head
    with pytest.raises(ValueError, match="needs LoRA adapters: pass lora_r"):
        tiny_model("bert", lora=False, lora_split="fedsa")
    with pytest.raises(ValueError, match="must be one of"):
        tiny_model("bert", lora_split="fedsa-lora")


def test_sdpa_attention_gives_the_same_logits_as_eager():
    ids = torch.randint(1, 64, (2, 8))
    ids[0, 5:] = PAD_ID
    eager = tiny_model("bert").eval()
    sdpa = tiny_model("bert", attn_implementation="sdpa").eval()
    torch.testing.assert_close(sdpa(ids), eager(ids))


def test_a_data_module_padding_with_another_id_is_refused():
    model = tiny_model("bert", pad_token_id=3)
    with pytest.raises(ValueError, match="pads input_ids with 0"):
        fit("sequential", model=model, rounds=1)


# ----------------------------------------------------------------------------- the splits


def test_lora_splits_select_what_they_say():
    model = tiny_model("bert")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    lora_a = {n for n in trainable if ".lora_A." in n}
    lora_b = {n for n in trainable if ".lora_B." in n}
    classifier = {n for n in trainable if ".modules_to_save." in n}
    assert lora_a and lora_b and classifier and lora_a | lora_b | classifier == set(trainable)
    assert set(LORA_SPLITS["fedsa"].personal(model)) == lora_b | classifier
    assert set(LORA_SPLITS["adapters"].personal(model)) == lora_a | lora_b
    assert set(LORA_SPLITS["local"].personal(model)) == set(trainable)
    assert set(LORA_SPLITS["fedrep"].personal(model)) == classifier
    assert lora_split("fedsa").strategy_kwargs()["allow_frozen"] is True
    assert "head" not in lora_split("local").strategy_kwargs()


def test_lora_split_refuses_unknown_names_and_modules_without_adapters():
    with pytest.raises(ValueError, match="must be one of"):
        lora_split("fedsa-lora")
    with pytest.raises(ValueError, match="no trainable LoRA adapters"):
        lora_split("fedsa", tiny_model("bert", lora=False))


@pytest.mark.parametrize("split", sorted(LORA_SPLITS))
def test_each_split_keeps_exactly_its_personal_tensors_per_client(split):
    strategy, model = fit("vectorized", split=split, rounds=1)
    assert strategy.runner_report.runner == "vectorized"
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert set(strategy.federation.local_names) == set(LORA_SPLITS[split].personal(model))
    assert not frozen & (set(strategy.federation.local_names) | set(strategy.federation.shared_names))


# ----------------------------------------------------------------------------- vectorized == sequential


@pytest.mark.parametrize(
    "kind,split", [("bert", "fedsa"), ("bert", "fedrep"), ("gpt2", "fedrep"), ("gpt2", "fedsa")]
)
def test_vectorized_equals_sequential_with_dropout_off(kind, split):
    sequential, _ = fit("sequential", split=split, kind=kind, model=tiny_model(kind))
    vectorized, _ = fit("vectorized", split=split, kind=kind, model=tiny_model(kind))
    assert sequential.runner_report.runner == "sequential"
    assert vectorized.runner_report.runner == "vectorized"
    assert_same(sequential, vectorized)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_fedavg_vectorized_equals_sequential(kind):
    def run(runner):
        model = tiny_model(kind)
        strategy = FederatedStrategy(
            algorithm="fedavg", allow_frozen=True, clients_per_round=4, local_epochs=1, seed=1, runner=runner
        )
        quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0).fit(model, datamodule=text_data())
        return strategy

    sequential, vectorized = run("sequential"), run("vectorized")
    assert vectorized.runner_report.runner == "vectorized"
    assert_same(sequential, vectorized)


# ----------------------------------------------------------------------------- memory: the store and the checkpoint


def test_fedsa_store_holds_adapter_bytes_per_client_and_no_frozen_base():
    data = text_data(num_clients=6)
    strategy, model = fit("vectorized", data=data, rounds=2, clients_per_round=6)
    store = strategy.federation.store
    expected = adapter_bytes(model, "fedsa")
    base = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    assert expected < base / 4
    for client in range(6):
        assert sum(t.nbytes for t in store.local[client]) == expected  # a client's row: its adapters only
    assert len(store.local) == 6
    assert store.nbytes() >= 6 * expected
    assert store.nbytes() <= 2 * 16 * expected  # pooled chunks (16 rows at first), never a base copy


def test_checkpoint_holds_only_personal_tensors_per_client_and_resumes_exactly(tmp_path):
    def run(rounds, ckpt=None, callbacks=()):
        model = tiny_model("bert")
        strategy = FederatedStrategy(
            **lora_split("fedsa").strategy_kwargs(),
            clients_per_round=4,
            local_epochs=1,
            seed=1,
            runner="vectorized",
        )
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=rounds,
            limit_val_batches=0,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=text_data(), ckpt_path=ckpt)
        return strategy, model

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    _, model = run(2, callbacks=[checkpoint])
    saved = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    state = saved[CHECKPOINT_KEY]
    personal = LORA_SPLITS["fedsa"].personal(model)
    assert list(state["local_names"]) == personal
    named = dict(model.named_parameters())
    for client, tensors in state["clients"]["local"].items():
        assert [tuple(t.shape) for t in tensors] == [tuple(named[n].shape) for n in personal], client
    frozen = {n for n, p in named.items() if not p.requires_grad}
    assert not frozen & set(state["shared_names"])
    resumed, _ = run(3, ckpt=str(tmp_path / "last.ckpt"))
    straight, _ = run(3)
    assert_same(straight, resumed)
    # a client's adapter out of the checkpoint alone, as out of the live strategy
    from transformers import AutoModelForSequenceClassification

    from lightning_fedrep import personalized_state_dict

    state = personalized_state_dict(tmp_path / "last.ckpt", 2)
    folder = save_peft_adapter(model, tmp_path / "client2", state_dict=state, base_folder=tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "base"), folder
    ).eval()
    reference = tiny_model("bert").eval()
    reference.load_state_dict(state)
    ids = torch.randint(1, 64, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- export as a peft adapter


def test_exported_adapter_loads_into_peft_model_and_predicts_as_the_strategy(tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = text_data()
    strategy, model = fit("vectorized", data=data, rounds=2)
    data.setup("fit")
    client = 3
    personalized = strategy.client_model(client).eval()
    test = data.client_data(client, "test")
    x = test.dataset.tensors[0][test.indices].clone()
    assert (x == PAD_ID).any()  # padded sequences among them
    folder = save_peft_adapter(personalized, tmp_path / "client3", base_folder=tmp_path / "base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(tmp_path / "base")
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(base, folder).eval()
    mask = (x != PAD_ID).long()
    with torch.no_grad():
        expected = personalized(x)
        got = loaded(input_ids=x, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    other = save_peft_adapter(model, tmp_path / "client0", state_dict=strategy.client_state_dict(0))
    with torch.no_grad():
        theirs = (
            peft.PeftModel.from_pretrained(
                AutoModelForSequenceClassification.from_pretrained(tmp_path / "base"), other
            )
            .eval()(input_ids=x, attention_mask=mask)
            .logits
        )
    torch.testing.assert_close(theirs, strategy.client_model(0).eval()(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs, got)  # clients 0 and 3 hold different personal parts


# ----------------------------------------------------------------------------- the data


def test_permuted_label_text_rotates_labels_per_group():
    train, test = make_permuted_label_text(num_clients=4, samples_per_client=50, num_groups=2, seed=3)
    for client, data in enumerate(train):
        ids, labels = data.tensors
        keyword_class = torch.full_like(labels, -1)
        for c in range(2):
            words = torch.arange(1 + c * 4, 1 + (c + 1) * 4)
            keyword_class[torch.isin(ids, words).any(1)] = c
        assert (keyword_class >= 0).all()
        assert torch.equal(labels, (keyword_class + client % 2) % 2)
        lengths = (ids != PAD_ID).sum(1)
        assert lengths.min() >= 8 and lengths.max() <= 16
    assert len(test[0]) == 32


def test_permuted_label_text_refuses_a_vocabulary_without_background_words():
    with pytest.raises(ValueError, match="vocab_size"):
        PermutedLabelTextDataModule(vocab_size=9, num_classes=2, keywords_per_class=4)


def test_sent140_with_a_tokenizer_folder(tmp_path):
    from transformers import BertTokenizer

    from lightning_fedrep.data.sent140 import Sent140DataModule
    from tests.test_sent140 import TWEETS, write_sent140

    tokenizer_folder = write_tiny_tokenizer(tmp_path / "tok", BertTokenizer)
    train, test = write_sent140(tmp_path / "sent140", {"zoe": (5, 3), "amy": (4, 2)})
    dm = Sent140DataModule(str(train), str(test), tokenizer=str(tokenizer_folder), max_words=12)
    dm.setup("fit")
    tokenizer = BertTokenizer.from_pretrained(tokenizer_folder)
    assert dm.pad_token_id == 0 and dm.vocab_size == len(tokenizer)
    data = dm.client_data(0)
    ids = data.dataset.tensors[0][data.indices]
    expected = tokenizer(TWEETS[0], padding="max_length", truncation=True, max_length=12)["input_ids"]
    assert ids.shape == (5, 12) and ids[0].tolist() == expected
    with pytest.raises(ValueError, match="exactly one of glove_path"):
        Sent140DataModule(str(train), str(test))


def write_tiny_tokenizer(folder, tokenizer_class):
    """A WordPiece tokenizer over a handful of words, saved with ``save_pretrained`` (no download)."""
    from tests.test_sent140 import TWEETS

    words = sorted({w.lower() for tweet in TWEETS for w in tweet.replace("!", " ! ").split()})
    folder.mkdir(parents=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer_class(str(vocab)).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- the experiment, reduced


def test_personal_adapters_learn_permuted_labels_where_fedavg_cannot():
    """4 clients (two per label group), 8 rounds, a BERT of width 32: FedRep on the adapters 0.94, FedAvg 0.49
    (chance 0.5: one global classifier cannot fit flipped labels). About 2 s on one thread."""

    def accuracy(**settings):
        model = tiny_model("bert", config={**BERT, "hidden_size": 32}, attn_implementation="eager")
        data = text_data(
            num_clients=4, samples=48, batch_size=8, keywords_per_sample=3, test_samples_per_client=32
        )
        strategy = FederatedStrategy(clients_per_round=4, seed=0, runner="vectorized", **settings)
        trainer = quiet_trainer(strategy=strategy, max_epochs=8, limit_val_batches=0)
        trainer.fit(model, datamodule=data)
        return trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"]

    personal = accuracy(**lora_split("fedrep").strategy_kwargs(), head_epochs=2, body_epochs=1)
    fedavg = accuracy(algorithm="fedavg", allow_frozen=True, local_epochs=3)
    print(f"personalized (FedRep on adapters) {personal:.3f}, FedAvg {fedavg:.3f}")
    assert personal > 0.9, personal
    assert fedavg < 0.7, fedavg


# ----------------------------------------------------------------------------- dropout on: per-client randomness


def dropout_model(kind: str) -> HFSequenceClassifier:
    """A tiny model with dropout on everywhere: hidden, attention and classifier (0.1) and LoRA's (0.1)."""
    model = tiny_model(kind, dropout=0.1, lora_dropout=0.1, lr=3e-2)
    config = model.net.config
    hidden, attention = (
        ("hidden_dropout_prob", "attention_probs_dropout_prob")
        if kind == "bert"
        else (
            "resid_pdrop",
            "attn_pdrop",
        )
    )
    assert getattr(config, hidden) > 0 and getattr(config, attention) > 0
    assert model.net.peft_config["default"].lora_dropout > 0
    return model


def fedsa_strategy(
    runner: str = "vectorized", seed: int = 1, randomness: str = "per_client", **kwargs
) -> FederatedStrategy:
    settings = dict(lora_split("fedsa").strategy_kwargs(), clients_per_round=4, local_epochs=1, seed=seed)
    return FederatedStrategy(**{**settings, **kwargs}, runner=runner, randomness=randomness)


def assert_per_client_vectorized(strategy: FederatedStrategy) -> None:
    report = strategy.runner_report
    assert report.runner == "vectorized" and report.randomness == "per_client"
    assert report.randomness_contract.startswith("per_client:")


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_dropout_on_runs_vectorized_per_client_reproducibly_and_across_a_resume(kind, tmp_path):
    def run(rounds, ckpt=None, callbacks=()):
        strategy = fedsa_strategy()
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=rounds,
            limit_val_batches=0,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
            default_root_dir=tmp_path,
        )
        trainer.fit(dropout_model(kind), datamodule=text_data(), ckpt_path=ckpt)
        return strategy

    run(2, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)])
    straight = run(3)
    assert_per_client_vectorized(straight)
    assert_same(straight, run(3))  # the same seed, the same numbers, bit for bit
    resumed = run(3, ckpt=str(tmp_path / "last.ckpt"))
    assert_per_client_vectorized(resumed)
    assert_same(straight, resumed)  # and after a resume at a round boundary


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_auto_runs_dropout_on_sequentially_under_exact_and_vectorized_under_per_client(kind):
    exact = fedsa_strategy("auto", randomness="exact")
    quiet_trainer(strategy=exact, max_epochs=1, limit_val_batches=0).fit(
        dropout_model(kind), datamodule=text_data()
    )
    assert exact.runner_report.runner == "sequential"
    assert exact.runner_report.randomness_contract.startswith("sequential:")
    assert "randomness='per_client' lets the vectorized runner" in exact.runner_report.reason
    per_client = fedsa_strategy("auto")
    quiet_trainer(strategy=per_client, max_epochs=1, limit_val_batches=0).fit(
        dropout_model(kind), datamodule=text_data()
    )
    assert_per_client_vectorized(per_client)


def dropout_accuracy(kind: str, runner: str, seed: int) -> float:
    """Mean personalized test accuracy of FedSA on a tiny model with dropout on, every client every round.

    Only the dropout draws change with ``seed``: the model's initial weights and the data are the same for
    every seed; the sequential runner draws from the global generator (``seed_everything``), the vectorized
    one from the strategy's ``seed``."""
    model = dropout_model(kind)
    L.seed_everything(seed, verbose=False)
    data = text_data(
        num_clients=4, samples=32, batch_size=16, keywords_per_sample=3, test_samples_per_client=16
    )
    strategy = fedsa_strategy(runner, seed=seed, local_epochs=2)
    trainer = quiet_trainer(strategy=strategy, max_epochs=6, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    assert strategy.runner_report.runner == runner
    return trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_dropout_on_accuracy_over_seeds_matches_the_sequential_runner_within_noise(kind):
    """Five seeds on each runner (4 clients of 32 permuted-label keyword sequences, batch 16, FedSA, 6 rounds
    of 2 local epochs, dropout 0.1 in the model and in LoRA): the mean accuracies agree within three standard errors of their
    difference (the seeds' sample standard deviations over sqrt(5), combined), or 0.02 where the seeds agree
    closely. Chance is 0.5; both runners must have learnt (above 0.65)."""
    seeds = range(5)
    sequential = [dropout_accuracy(kind, "sequential", s) for s in seeds]
    vectorized = [dropout_accuracy(kind, "vectorized", s) for s in seeds]
    print(kind, "sequential", sequential, "vectorized", vectorized)
    error = math.sqrt(statistics.variance(sequential) / 5 + statistics.variance(vectorized) / 5)
    gap = abs(statistics.mean(sequential) - statistics.mean(vectorized))
    assert gap <= max(3 * error, 0.02), (sequential, vectorized)
    assert min(statistics.mean(sequential), statistics.mean(vectorized)) > 0.65, (sequential, vectorized)
    assert len(set(vectorized)) > 1 or len(set(sequential)) > 1  # the seeds do draw differently
