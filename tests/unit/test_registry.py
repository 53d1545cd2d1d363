"""The extension-point registries (``dsv4.registry``): a fake attention backend, data source and MoE dispatcher,
each defined here and registered (plus, for a config group, one YAML file in this test's own config directory),
go through the normal config path (compose -> :func:`~dsv4.training.spec.build_run_spec`) and give the numbers of
the built-in they delegate to; no registration outlives its test."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hydra import compose, initialize_config_dir

from dsv4.config import DSV4Config
from dsv4.data.datamodule import DSV4DataModule
from dsv4.data.sources import DATA_SOURCES, DataSource, Document, SourceArgs, build_documents
from dsv4.model import DSV4ForCausalLM
from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_backend import ATTENTION_BACKENDS, AttentionBackend, resolve_attention_backend
from dsv4.model.dispatch import LocalDispatcher
from dsv4.model.sparse_attention import sparse_attention
from dsv4.parallel.dispatch import (TOKEN_DISPATCHERS, DispatcherEntry, build_dispatcher, check_dispatcher_available,
                                    dispatcher_needs_uniform_tokens, resolve_dispatcher)
from dsv4.parallel.expert_shard import apply_expert_parallel
from dsv4.registry import Registry
from dsv4.training.schema import register_schema
from dsv4.training.spec import RunSpec, build_run_spec
from tests.unit.test_conf import CONF

BUILT_IN = {"model.attention_backend": ("torch", "triton"), "dispatcher": ("local", "alltoall", "allgather", "deepep"),
            "data.kind": ("stdlib", "jsonl", "hf")}
TEXTS = ["def f(x):\n    return x + 1\n" * 3, "héllo wörld " * 9, "a short one", "class A:\n    pass\n" * 5]


@pytest.fixture
def register():
    """``register(registry, name, entry)``: registered for this test only."""
    added: list[tuple[Registry, str]] = []

    def add(registry: Registry, name: str, entry):
        registry.register(name, entry)
        added.append((registry, name))
        return entry

    yield add
    for registry, name in reversed(added):
        registry.unregister(name)


@pytest.fixture
def calls() -> Counter:
    return Counter()


def _spec(tmp_path, overrides, yamls=None) -> RunSpec:
    """The run specification of ``conf/finetune.yaml`` plus the groups' YAML files in ``yamls``
    (``{"data/fake.yaml": text}``) from a directory of this test on Hydra's search path: a new option is one file,
    ``conf/`` stays untouched."""
    (tmp_path / "conf").mkdir(exist_ok=True)
    for name, text in (yamls or {}).items():
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                                                         "seq_len=256", "logger=none", "callbacks=none", *overrides])
    return build_run_spec(cfg)


def _forward(model: DSV4ForCausalLM, ids: torch.Tensor):
    """Logits, loss and the parameter gradients of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids.roll(-1, dims=1))
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                                    if p.grad is not None}


def _assert_same_run(got, want):
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = got, want
    assert torch.equal(logits, logits_ref) and torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert torch.equal(grads[name], grads_ref[name]), name


def _models(config: DSV4Config, reference: DSV4Config) -> tuple[DSV4ForCausalLM, DSV4ForCausalLM]:
    torch.manual_seed(0)
    model = DSV4ForCausalLM(config)
    ref = DSV4ForCausalLM(reference)
    ref.load_state_dict(model.state_dict())
    return model, ref


# --------------------------------------------------------------------------------------------- the registry


def test_registry_contract():
    reg: Registry[int] = Registry("group.key", "widget", reserved=("auto",))
    assert reg.register("one", 1) == 1
    assert reg.register("two")(2) == 2  # the decorator form returns what it registers
    assert reg.names() == ("one", "two") and list(reg) == ["one", "two"] and len(reg) == 2
    assert reg.get("two") == 2 and "one" in reg and "three" not in reg and ["x"] not in reg
    assert reg.check("one") == "one" and reg.check("auto", allow=("auto",)) == "auto"
    with pytest.raises(ValueError, match=r"^`group\.key`: unknown widget 'three'; expected one of one, two$"):
        reg.get("three")
    with pytest.raises(ValueError, match=r"^`group\.key`: unknown widget 'three'; expected one of auto, one, two$"):
        reg.check("three", allow=("auto",))
    with pytest.raises(ValueError, match="unknown widget"):
        reg.get(["one"])  # an unhashable config value is just unknown
    for name, match in (("one", "already registered"), ("auto", "reserved"), ("", "non-empty string")):
        with pytest.raises(ValueError, match=match):
            reg.register(name, 0)
    assert reg.unregister("one") == 1 and reg.names() == ("two",)
    with pytest.raises(ValueError, match="unknown widget 'one'"):
        reg.unregister("one")


def test_unknown_names_name_the_config_key():
    with pytest.raises(ValueError, match=r"`model\.attention_backend`: unknown attention backend 'fake'; expected "
                                         r"one of auto, torch, triton"):
        resolve_attention_backend("fake", "cpu")
    with pytest.raises(ValueError, match=r"DSV4Config\.attention_backend: must be one of \('auto', 'torch', "
                                         r"'triton'\), got 'fake'"):
        DSV4Config.preset("tiny", attention_backend="fake")
    with pytest.raises(ValueError, match=r"`dispatcher`: unknown MoE dispatcher 'fake'; expected one of auto, local"):
        resolve_dispatcher("fake", 1)
    with pytest.raises(ValueError, match=r"`data\.kind`: data kind 'fake' is not one of \('stdlib', 'jsonl', 'hf'\)"):
        build_documents("fake")


# ---------------------------------------------------------------------------------------- attention backend


def test_fake_attention_backend_runs_the_model_like_torch(tmp_path, register, calls):
    """A backend is its kernel plus a registration: selected by ``model.attention_backend``, it runs in every
    attention layer, and (delegating to the torch reference) gives the torch backend's logits, loss and grads."""

    def counting_attention(*args, **kwargs):
        calls["attention"] += 1
        return sparse_attention(*args, **kwargs)

    register(ATTENTION_BACKENDS, "fake", AttentionBackend(attention=lambda: counting_attention))
    spec = _spec(tmp_path, ["model.attention_backend=fake"])
    config = spec.model
    assert config == DSV4Config.preset("tiny", attention_backend="fake") and spec.attention_backend == "fake"
    model, ref = _models(config, DSV4Config.preset("tiny", attention_backend="torch"))
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    got = _forward(model, ids)
    layers = sum(isinstance(m, DSV4Attention) for m in model.modules())
    assert layers == config.num_hidden_layers + config.num_nextn_predict_layers and calls["attention"] >= layers
    _assert_same_run(got, _forward(ref, ids))


def test_fake_backend_declares_its_devices_and_auto(register, calls):
    """``check`` refuses a device with the backend's own message; ``auto`` takes the first registered backend
    that claims the device (triton claims CUDA only, so on the CPU a backend that claims it wins)."""

    def cpu_only(device_type: str) -> None:
        if device_type != "cpu":
            raise ValueError(f"model.attention_backend=fake runs on the CPU only, not {device_type}")

    def counting_attention(*args, **kwargs):
        calls["attention"] += 1
        return sparse_attention(*args, **kwargs)

    assert resolve_attention_backend("auto", "cpu") == "torch"
    register(ATTENTION_BACKENDS, "fake", AttentionBackend(attention=lambda: counting_attention, check=cpu_only,
                                                          auto=lambda device_type: device_type == "cpu"))
    with pytest.raises(ValueError, match="runs on the CPU only, not cuda"):
        resolve_attention_backend("fake", "cuda")
    assert resolve_attention_backend("auto", "cpu") == "fake" and resolve_attention_backend("auto", "meta") == "torch"
    model, ref = _models(DSV4Config.preset("tiny"), DSV4Config.preset("tiny", attention_backend="torch"))
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(2))
    _assert_same_run(_forward(model, ids), _forward(ref, ids))  # attention_backend=auto picked the fake
    assert calls["attention"] > 0


# --------------------------------------------------------------------------------------------- data source


def test_fake_data_source_feeds_the_datamodule_like_jsonl(tmp_path, register, calls):
    """A source is its documents factory plus a registration and a ``conf/data/`` YAML (here in the test's own
    config directory): the data group builds it, and it yields the documents (and packed rows) the built-in JSONL
    source makes of the same texts."""

    def fake_documents(args: SourceArgs) -> list[Document]:
        calls["documents"] += 1
        texts = TEXTS * args.options.get("repeat", 1)
        return [Document(args.tokenizer.encode(t), None, f"fake:{i}")
                for i, t in enumerate(texts[:args.max_documents])]

    register(DATA_SOURCES, "fake", DataSource(fake_documents, options=("repeat",)))
    spec = _spec(tmp_path, ["data=fake", "data.max_documents=7"],
                 {"data/fake.yaml": "kind: fake\ntokenizer: byte\noptions:\n  repeat: 2\n"})
    source = dict(spec.data)
    assert source["kind"] == "fake" and source["options"] == {"repeat": 2}

    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 2))
    oracle = {"kind": "jsonl", "path": str(jsonl), "tokenizer": "byte", "max_documents": 7}
    docs, want = build_documents(**source), build_documents(**oracle)
    assert [list(d.ids) for d in docs] == [list(d.ids) for d in want] and len(docs) == 7
    assert [d.loss_mask for d in docs] == [d.loss_mask for d in want]

    shape = {"seq_len": spec.seq_len, "shard_multiple": spec.model.shard_multiple, "overlong": spec.overlong}
    rows = DSV4DataModule(source, **shape).build_dataset()  # what the run builds from the spec
    rows_ref = DSV4DataModule(oracle, **shape).build_dataset()
    assert calls["documents"] == 2 and rows.pieces == rows_ref.pieces
    for name in ("input_ids", "labels", "seq_ids", "positions"):
        assert torch.equal(getattr(rows.batch, name), getattr(rows_ref.batch, name)), name

    with pytest.raises(ValueError, match=r"`data\.options`: data kind 'fake' does not read \['repaet'\]"):
        build_documents("fake", options={"repaet": 2})
    with pytest.raises(ValueError, match=r"`data\.options`: data kind 'jsonl' does not read \['repeat'\]"):
        build_documents(**oracle, options={"repeat": 2})  # the built-ins read no options


# ---------------------------------------------------------------------------------------------- dispatcher


def test_fake_dispatcher_runs_the_moe_like_local(tmp_path, register, calls):
    """A dispatcher is a ``TokenDispatcher`` plus a registration and a ``conf/dispatcher/`` YAML: the dispatcher
    group selects it, the start-up checks and the expert-parallel set-up ask its entry, and (delegating to
    ``LocalDispatcher``) every MoE layer gives LocalDispatcher's output, loss and grads."""

    class CountingDispatcher:
        needs_uniform_tokens = False

        def run(self, experts, x, topk_ids, topk_weights):
            calls["dispatch"] += 1
            return LocalDispatcher().run(experts, x, topk_ids, topk_weights)

    register(TOKEN_DISPATCHERS, "fake", DispatcherEntry(build=lambda ep_group: CountingDispatcher(),
                                                        expert_parallel=False))
    spec = _spec(tmp_path, ["dispatcher=fake"], {"dispatcher/fake.yaml": "name: fake\n"})
    name = spec.dispatcher  # resolved and checked for the device by the spec
    assert name == "fake" and dispatcher_needs_uniform_tokens(name) is False
    assert check_dispatcher_available(name, "cpu") is None
    with pytest.raises(ValueError, match=r"^`dispatcher`=fake keeps every expert on every rank and cannot run "
                                         r"`ep`=2; use dispatcher=auto or alltoall \(or allgather, deepep\)$"):
        resolve_dispatcher("fake", 2)
    assert isinstance(build_dispatcher(name), CountingDispatcher)

    config = spec.model
    model, ref = _models(config, config)
    assert isinstance(apply_expert_parallel(model, name, None, spec.device_type), CountingDispatcher)
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(3))
    got = _forward(model, ids)
    moe_layers = sum(1 for m in model.modules() if isinstance(getattr(m, "dispatcher", None), CountingDispatcher))
    assert moe_layers > 0 and calls["dispatch"] >= moe_layers
    _assert_same_run(got, _forward(ref, ids))


def test_registrations_do_not_leak():
    """The fixture undid every registration above: the registries hold the built-ins only."""
    for registry in (ATTENTION_BACKENDS, TOKEN_DISPATCHERS, DATA_SOURCES):
        assert registry.names() == BUILT_IN[registry.key]
