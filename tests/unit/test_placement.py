"""Placement, the dense split, dispatch / combine and the rebalancer, without gRPC: the shard's compute
(services.experts.shard) on tiny checkpoints against the model's own local FFN."""
from __future__ import annotations

import json

import pytest
import torch

from services.experts.shard import ExpertShard, FfnUnit, ffn_forward
from shared import tensor_codec
from shared.model.placement import Placement, combine, dense_slice, load_placement, plan_dispatch, replica_table
from shared.shards.rebalance import imbalance, replicate_hot


# ---------------------------------------------------------------- placement
def test_contiguous_placement_and_dense_slices():
    p = Placement(num_shards=3, num_experts=8)
    assert [p.shards(0, e, dense=False) for e in range(8)] == [(0,), (0,), (0,), (1,), (1,), (1,), (2,), (2,)]
    assert [p.shards(5, s, dense=True) for s in range(3)] == [(0,), (1,), (2,)]
    assert [dense_slice(10, s, 3) for s in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [dense_slice(1536, s, 2) for s in range(2)] == [(0, 768), (768, 1536)]
    assert p.holds(1, 0, 4, dense=False) and not p.holds(0, 0, 4, dense=False)


def test_placement_json_round_trip_and_errors(tmp_path):
    p = Placement(2, 4, {3: ((0,), (0, 1), (1,), (1,))})
    path = tmp_path / "placement.json"
    p.save(str(path))
    assert json.loads(path.read_text())["layers"] == {"3": [[0], [0, 1], [1], [1]]}
    q = load_placement(str(path), num_shards=2, num_experts=4)
    assert q == p and q.shards(3, 1, dense=False) == (0, 1) and q.shards(2, 1, dense=False) == (0,)
    assert load_placement(None, 2, 0) == Placement(2, 0)
    with pytest.raises(ValueError, match="3 shards"):
        load_placement(str(path), num_shards=3, num_experts=4)
    with pytest.raises(ValueError, match="distinct"):
        Placement(2, 4, {0: ((0,), (0, 2), (1,), (1,))})
    with pytest.raises(ValueError, match="lists 3 units"):
        Placement(2, 4, {0: ((0,), (1,), (1,))})
    with pytest.raises(ValueError, match="num_shards"):
        Placement.from_json({"layers": {}})



def test_replicated_placement_puts_every_unit_on_every_shard(tmp_path):
    p = load_placement("replicated", num_shards=3, num_experts=0)
    assert [p.shards(7, s, dense=True) for s in range(3)] == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    assert all(p.holds(shard, 0, unit, dense=True) for shard in range(3) for unit in range(3))
    q = load_placement("replicated", num_shards=2, num_experts=4)
    assert [q.shards(0, e, dense=False) for e in range(4)] == [(0, 1), (0, 1), (1, 0), (1, 0)]
    path = tmp_path / "p.json"
    q.save(str(path))
    assert load_placement(str(path), 2, 4) == q
    with pytest.raises(ValueError, match="replicas must be in"):
        Placement(2, 0, replicas=3)

def test_plan_groups_slots_by_shard_and_spreads_replicas():
    # 4 experts on 2 shards; expert 1 replicated on both. 3 tokens, top-2.
    p = Placement(2, 4, {0: ((0,), (0, 1), (1,), (1,))})
    ids = torch.tensor([[1, 2], [0, 1], [3, 1]])                        # [T, k]
    plan = plan_dispatch(ids, replica_table(p.table(0, dense=False)))
    # expert 1: token 0 -> replica 0 % 2 = shard 0, token 1 -> shard 1, token 2 -> shard 0
    assert plan[0].slots.tolist() == [0, 2, 5] and plan[0].rows.tolist() == [0, 1, 2]
    assert plan[1].slots.tolist() == [1, 3, 4] and plan[1].rows.tolist() == [0, 1, 2]
    assert plan[0].one_row_per_slot
    # shard 0 avoided: its replicated expert goes to shard 1, expert 0 has nowhere else to go
    plan = plan_dispatch(ids, replica_table(p.table(0, dense=False), frozenset({0})))
    assert plan[0].slots.tolist() == [2] and plan[1].slots.tolist() == [0, 1, 3, 4, 5]
    assert plan[1].rows.tolist() == [0, 1, 2] and plan[1].slot_rows.tolist() == [0, 0, 1, 2, 2]
    assert not plan[1].one_row_per_slot
    # a retry plans only some slots
    again = plan_dispatch(ids, replica_table(p.table(0, dense=False), frozenset({0})), torch.tensor([0, 1, 3]))
    assert list(again) == [1] and again[1].slots.tolist() == [0, 1, 3] and again[1].rows.tolist() == [0, 1]
    assert again[1].slot_rows.tolist() == [0, 0, 1]


def test_tensor_codec_round_trip_and_errors():
    for t in (torch.randn(3, 5), torch.randn(2, 4).bfloat16(), torch.randn(7).half(), torch.arange(6).int(),
              torch.arange(4)):
        dtype, shape, data = tensor_codec.encode(t)
        assert len(data) == t.numel() * t.element_size()
        back = tensor_codec.decode(dtype, shape, data)
        assert back.dtype == t.dtype and torch.equal(back, t)
        back += 1                                                       # owns writable memory
    assert tensor_codec.encode(torch.tensor([1.0]))[2] == b"\x00\x00\x80\x3f"   # little-endian
    with pytest.raises(tensor_codec.TensorFormatError, match="needs 24 bytes"):
        tensor_codec.decode("float32", [2, 3], b"\0" * 20)
    with pytest.raises(tensor_codec.TensorFormatError, match="unknown tensor dtype"):
        tensor_codec.decode("float64", [1], b"\0" * 8)


# ---------------------------------------------------------------- tiny checkpoints
def _save_tiny(path, family: str):
    import transformers
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, intermediate_size=40))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=24,
                                                                           num_local_experts=6,
                                                                           num_experts_per_tok=2))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from shared.model.registry import build_model
    path = tmp_path_factory.mktemp("llama")
    _save_tiny(path, "llama")
    return str(path), build_model(str(path), 64, torch.float32, "cpu", progress=False)[0]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    from shared.model.registry import build_model
    path = tmp_path_factory.mktemp("mixtral")
    _save_tiny(path, "mixtral")
    return str(path), build_model(str(path), 64, torch.float32, "cpu", progress=False)[0]


def _shards(path: str, placement: Placement) -> list[ExpertShard]:
    return [ExpertShard(path, placement, s, torch.float32, torch.device("cpu")) for s in range(placement.num_shards)]


def _distributed(shards: list[ExpertShard], layer: int, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor | None, avoid: frozenset[int] = frozenset(), dense: bool = False
                 ) -> torch.Tensor:
    """What RemoteDense / RemoteExperts do, minus the wire: plan, each shard computes its slots, combine."""
    placement = shards[0].placement
    plan = plan_dispatch(ids, replica_table(placement.table(layer, dense), avoid))
    flat_ids, flat_w = ids.reshape(-1), None if weights is None else weights.reshape(-1)
    parts = []
    for s, ss in plan.items():
        rows = None if ss.one_row_per_slot else ss.slot_rows
        out = shards[s].forward(layer, x[ss.rows], flat_ids[ss.slots].int(),
                                None if flat_w is None else flat_w[ss.slots], rows)
        parts.append((ss.rows, out))
    return combine(x.shape[0], parts)


def shape(w) -> tuple[int, int]:
    """A unit's weight [O, I]: a tensor, or a PackedLinear (fp32 with the AVX2 rows kernel, bf16 with oneDNN)."""
    return (w.out_features, w.in_features) if hasattr(w, "out_features") else tuple(w.shape)


def weight_bytes(model) -> int:
    """Parameters and the packed copies of PackedLinears (not parameters: shared.ops.packed_linear)."""
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(getattr(m, "packed_nbytes", 0) for m in model.modules()))


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_dense_split_sums_to_the_whole_ffn(tiny_llama, num_shards):
    path, model = tiny_llama
    shards = _shards(path, Placement(num_shards))
    for s, shard in enumerate(shards):                     # shard s holds slice s of every layer, nothing else
        assert {layer: sorted(u) for layer, u in shard.layers.items()} == {0: [s], 1: [s]}
        lo, hi = dense_slice(40, s, num_shards)
        unit = shard.layers[0][s]
        assert shape(unit.gate_up) == (2 * (hi - lo), 32) and shape(unit.down) == (32, hi - lo)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(num_shards).expand(7, -1)
    with torch.inference_mode():
        for layer in (0, 1):
            want = model.layers[layer].mlp(x)
            got = _distributed(shards, layer, x, ids, None, dense=True)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if num_shards == 1:
                assert torch.equal(got, want)              # the same matmuls: bit for bit


def _routing(model, layer: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        ids, weights = model.layers[layer].mlp.gate(x)
    return x, ids, weights


def test_experts_on_shards_equal_local_experts_whatever_the_placement(tiny_mixtral):
    path, model = tiny_mixtral
    contiguous = Placement(2, 6)
    everywhere = Placement(2, 6, {layer: tuple((0, 1) for _ in range(6)) for layer in (0, 1)})
    loads = torch.tensor([[50, 1, 1, 1, 1, 1], [1, 1, 1, 1, 40, 30]])
    rebalanced = replicate_hot(loads, contiguous, extra=2)
    one = Placement(1, 6)
    results = []
    for placement in (one, contiguous, everywhere, rebalanced):
        shards = _shards(path, placement)
        for layer in (0, 1):
            x, ids, weights = _routing(model, layer, 9, seed=layer)
            with torch.inference_mode():
                want = model.layers[layer].mlp.backend.moe(layer, x, ids, weights)    # LocalExperts
                got = _distributed(shards, layer, x, ids, weights)
            if placement == one:
                assert torch.equal(got, want)              # same grouping, same order: bit for bit
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            results.append(got)
    for layer in (0, 1):                                   # every placement gives the same numbers
        for r in results[2 + layer::2]:
            torch.testing.assert_close(r, results[layer], rtol=1e-6, atol=1e-7)


def test_failover_to_replicas_and_on_demand_loading(tiny_mixtral):
    path, model = tiny_mixtral
    everywhere = Placement(2, 6, {0: tuple((0, 1) for _ in range(6))})
    shards = _shards(path, everywhere)
    x, ids, weights = _routing(model, 0, 5, seed=3)
    with torch.inference_mode():
        want = model.layers[0].mlp.backend.moe(0, x, ids, weights)
        for down in ({0}, {1}):                            # either shard alone serves layer 0
            torch.testing.assert_close(_distributed(shards, 0, x, ids, weights, frozenset(down)), want,
                                       rtol=1e-6, atol=1e-7)
    # layer 1 is contiguous: shard 0 lacks experts 3..5 until it loads them from the checkpoint
    from shared.errors import InvalidRequest
    x1, ids1, w1 = _routing(model, 1, 5, seed=4)
    with pytest.raises(InvalidRequest, match="does not hold"):
        shards[0].forward(1, x1[:1], torch.tensor([4], dtype=torch.int32))
    assert shards[0].load([(1, 3), (1, 4), (1, 5), (1, 0)]) == 3
    assert sorted(shards[0].layers[1]) == list(range(6))
    with torch.inference_mode():
        want = model.layers[1].mlp.backend.moe(1, x1, ids1, w1)
        got = shards[0].forward(1, x1, ids1.reshape(-1).int(), w1.reshape(-1), torch.arange(10) // 2)  # 2 slots a row
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidRequest, match="no FFN unit"):
        shards[0].load([(1, 9)])


def test_shard_rejects_malformed_dispatches(tiny_llama):
    from shared.errors import InvalidRequest
    path, _ = tiny_llama
    shard = _shards(path, Placement(2))[1]
    x = torch.randn(3, 32)
    ok = torch.ones(3, dtype=torch.int32)
    for args, words in [((7, x, ok), "no unit of layer 7"), ((0, torch.randn(3, 31), ok), "hidden must be"),
                        ((0, x, torch.zeros(3, dtype=torch.int32)), "does not hold units [0]"),
                        ((0, x, torch.ones(4, dtype=torch.int32)), "send token_index"),
                        ((0, x, ok, torch.ones(2)), "weights must have shape"),
                        ((0, x, ok, None, torch.tensor([0, 1, 3])), "token_index must be")]:
        with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
            shard.forward(*args)


def test_ffn_forward_sums_each_rows_slots_in_unit_order():
    g = torch.Generator().manual_seed(0)
    units = {u: FfnUnit(torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)) for u in range(3)}
    x = torch.randn(2, 6, generator=g)                                 # 2 token rows, 3 slots
    out = ffn_forward(units, x, torch.tensor([2, 0, 1]), torch.tensor([0.5, 0.25, 2.0]), torch.tensor([0, 0, 1]))
    want = torch.stack([0.25 * units[0](x[:1])[0] + 0.5 * units[2](x[:1])[0], 2.0 * units[1](x[1:])[0]])
    torch.testing.assert_close(out, want)


# ---------------------------------------------------------------- rebalancer
def test_rebalancer_replicates_the_hottest_experts_on_the_least_loaded_shards():
    p = Placement(2, 4)                                                # experts 0, 1 on shard 0; 2, 3 on shard 1
    loads = torch.tensor([[90, 10, 20, 20]])
    assert imbalance(loads, p, 0) == pytest.approx(100 / 70)
    q = replicate_hot(loads, p, extra=1)
    assert q.table(0, dense=False) == ((0, 1), (0,), (1,), (1,))       # the hot expert gains a replica on shard 1
    assert imbalance(loads, q, 0) < imbalance(loads, p, 0)
    r = replicate_hot(loads, p, extra=10)                              # at most one replica per shard
    assert all(len(s) <= 2 for s in r.table(0, dense=False))
    assert replicate_hot(loads, p, extra=0) == p.with_layers({0: p.table(0, dense=False)})
    assert replicate_hot(torch.zeros(1, 4), p, extra=3) == p           # no load measured, nothing to do
    with pytest.raises(ValueError, match="cover 3 units"):
        replicate_hot(torch.ones(1, 3), p, extra=1)


def test_attach_routes_every_layer_through_the_client_and_frees_local_weights(tiny_llama, tiny_mixtral):
    from shared.model.registry import build_model
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import RemoteExperts, RemoteMLP, attach_expert_shards, ffn_kinds
    for path, kinds in ((tiny_llama[0], [True, True]), (tiny_mixtral[0], [False, False])):
        model, _ = build_model(path, 64, torch.float32, "cpu", progress=False)
        assert ffn_kinds(model) == kinds
        experts = 0 if kinds[0] else 6
        client = ExpertsClient(["127.0.0.1:1", "127.0.0.1:2"], Placement(2, experts), kinds)
        before = weight_bytes(model)
        freed = attach_expert_shards(model, client)
        assert freed == before - weight_bytes(model) > 0
        for layer in model.layers:
            assert isinstance(layer.mlp, RemoteMLP) if kinds[0] else isinstance(layer.mlp.backend, RemoteExperts)
        client.close()


def test_configs_name_the_shards():
    import argparse

    from services.experts.config import ExpertsConfig
    from services.launcher import ServeConfig
    from services.target.config import TargetConfig
    from shared.config import add_config_arguments, config_from_args

    def parse(cls, argv):
        p = argparse.ArgumentParser()
        add_config_arguments(p, cls)
        return config_from_args(cls, p.parse_args(argv))

    assert parse(ServeConfig, []).expert_shards == 0                  # default: FFNs in the target
    serve = parse(ServeConfig, ["--expert-shards", "3", "--target-address", "h:100", "--target-replicas", "2"])
    assert serve.expert_addresses() == ["h:102", "h:103", "h:104"]     # after the targets' ports
    assert parse(TargetConfig, []).expert_addresses() == []
    assert parse(TargetConfig, ["--expert-shards", "a:1, b:2"]).expert_addresses() == ["a:1", "b:2"]
    cfg = parse(ExpertsConfig, ["--shard-index", "2", "--num-shards", "3"])
    assert (cfg.shard_index, cfg.num_shards, cfg.torch_dtype()) == (2, 3, torch.float32)
    for cls, argv in ((ExpertsConfig, ["--shard-index", "3", "--num-shards", "3"]),
                      (ExpertsConfig, ["--num-shards", "0"]), (ExpertsConfig, ["--dtype", "int8"]),
                      (TargetConfig, ["--expert-timeout-s", "0"]), (TargetConfig, ["--expert-shards", ","]),
                      (ServeConfig, ["--expert-shards", "-1"])):
        with pytest.raises(ValueError):
            parse(cls, argv)


def test_bf16_shards_prepack_their_units_and_compute_what_plain_weights_compute(tiny_llama, tiny_mixtral,
                                                                                monkeypatch):
    """bf16 on CPU: dense slices and experts are PackedLinears (shared.ops.packed_linear), on oneDNN's packed path
    bit-identical to the F.linear of the same bf16 weights, with the same byte count."""
    from services.experts import shard as shard_mod
    from shared.ops import rows_gemm_bf16
    from shared.ops.packed_linear import PackedLinear, packing_available
    if not packing_available():
        pytest.skip("no oneDNN prepacked bf16 linear (torch build or CPU)")
    monkeypatch.setattr(rows_gemm_bf16, "packable", lambda w: False)    # the AVX512-BF16 kernel pads its panels
    for path, dense in ((tiny_llama[0], True), (tiny_mixtral[0], False)):
        packed = ExpertShard(path, Placement(2, 0 if dense else 6), 0, torch.bfloat16, torch.device("cpu"))
        with monkeypatch.context() as m:
            m.setattr(shard_mod, "_prepacked", lambda w: w)
            plain = ExpertShard(path, Placement(2, 0 if dense else 6), 0, torch.bfloat16, torch.device("cpu"))
        unit = next(iter(packed.layers[0].values()))
        assert type(unit.gate_up) is PackedLinear and type(unit.down) is PackedLinear
        assert packed.weight_bytes == plain.weight_bytes > 0
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
        units = sorted(packed.layers[0])
        ids = torch.tensor([units[i % len(units)] for i in range(5)], dtype=torch.int32)
        with torch.inference_mode():
            assert torch.equal(packed.forward(0, x, ids), plain.forward(0, x, ids))


def test_a_shard_reads_the_config_the_targets_read(tiny_mixtral):
    """`upesi serve --hf-overrides` reaches the expert shards too: a model cut to its first layer on the targets
    is cut on the shards (which then hold that layer's experts only, and report one layer to the target)."""
    import argparse

    from services.experts.config import ExpertsConfig
    from shared.config import add_config_arguments, config_from_args
    path, _ = tiny_mixtral
    whole = ExpertShard(path, Placement(1, 6), 0, torch.float32, torch.device("cpu"))
    cut = ExpertShard(path, Placement(1, 6), 0, torch.float32, torch.device("cpu"),
                      hf_overrides={"num_hidden_layers": 1})
    assert (whole.cfg.num_layers, sorted(whole.layers)) == (2, [0, 1])
    assert (cut.cfg.num_layers, sorted(cut.layers)) == (1, [0])
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ExpertsConfig)
    cfg = config_from_args(ExpertsConfig, parser.parse_args(["--hf-overrides", '{"num_hidden_layers": 1}']))
    assert cfg.hf_overrides == '{"num_hidden_layers": 1}'
    with pytest.raises(ValueError, match="hf_overrides"):
        config_from_args(ExpertsConfig, parser.parse_args(["--hf-overrides", "[1]"]))
