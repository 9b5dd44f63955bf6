"""Persistent decode inputs (issue 41): a graphed decode step's inputs reach the device in one copy of one packed
host buffer into the buffer whose views the graphs were captured over, padding written on the host, and nothing
else (no fill, no cast, no copy of the inputs or of the tokens a step launched ahead sampled) runs outside the
graph's replay and the sampler. Counted on the CPU twin with a TorchDispatchMode; tokens checked against the eager
path, greedy and seeded, overlap on and off, as the batch grows and shrinks through padded buckets."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.decode_inputs import DecodeInputs
from kvgate.engine.graph_inputs import PADDING, StaticInputs
from kvgate.engine.overlap import PENDING
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import random_prompts, tiny_source


@dataclass
class Call:
    """One runner call (a plain `run` or a `launch` ahead): the ops it issued outside the replay and the sampler."""
    kind: str
    replayed: int = 0
    ops: list[tuple[str, tuple, object]] = field(default_factory=list)


def aliases(func, args, out) -> bool:
    """A view of its input (slice, view...): moves no data. `to` is declared as one but copies when it must."""
    return func.is_view and isinstance(out, torch.Tensor) and (
        out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr())


class OpsOutsideTheGraph(TorchDispatchMode):
    """Records every op that is not a view, except while a graph replays or the sampler samples."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.calls and not self.inside and not aliases(func, args, out):
            self.calls[-1].ops.append((func.overloadpacket.__name__, args, out))
        return out

    @contextmanager
    def excluded(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def watch(self, engine: LLMEngine) -> None:
        runner, graphs = engine.runner, engine.runner.graphs

        def excluding(fn, counted: bool = False):
            def wrapper(*a, **k):
                if counted:
                    self.calls[-1].replayed += 1
                with self.excluded():
                    return fn(*a, **k)
            return wrapper

        def call(kind, fn):
            def wrapper(*a, **k):
                self.calls.append(Call(kind))
                return fn(*a, **k)
            return wrapper

        graphs.replays = {size: excluding(fn, counted=True) for size, fn in graphs.replays.items()}
        runner.sampler.sample = excluding(runner.sampler.sample)
        runner.run, runner.launch = call("run", runner.run), call("launch", runner.launch)


def requests(temperature: float) -> list[tuple[int, list[int], SamplingParams]]:
    """(the step it joins at, prompt, params): 3 from the start, 2 joining at step 6 and 2 at step 14; lengths such
    that the batch grows to 6 and shrinks through 5, 3, 1 (buckets 1, 2, 4, 6: padding rows in most steps). The
    fourth has a presence penalty: under overlap its steps are plain ones (a sync point), the others launched."""
    lengths, joins = [9, 30, 21, 12, 26, 17, 8], [0, 0, 0, 6, 6, 14, 14]
    return [(join, prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=n, ignore_eos=True,
                                          presence_penalty=0.5 if i == 3 else 0.0))
            for i, (join, prompt, n) in enumerate(zip(joins, random_prompts(7, 3, 25, seed=11), lengths))]


def engine_for(source, graphed: bool, overlap: str) -> LLMEngine:
    engine = LLMEngine(source, device="cpu", kv_cache_memory=1 << 20, max_num_seqs=6, overlap=overlap)
    if graphed:
        engine.runner.capture_graphs()  # on a CPU the graphs' twin: the same plan, replay runs the step eagerly
    return engine


def generate(engine: LLMEngine, reqs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished():
        for i, (join, prompt, params) in enumerate(reqs):
            if join == step:
                engine.add_request(str(i), prompt, params)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return out


@pytest.fixture(scope="module")
def source():
    return tiny_source("llama", seed=11)[0]


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_graphed_decode_step_sends_its_inputs_in_one_copy_and_fills_or_casts_nothing_outside_the_graph(
        source, overlap, temperature):
    reqs = requests(temperature)
    eager = generate(engine_for(source, graphed=False, overlap="off"), reqs)
    engine = engine_for(source, graphed=True, overlap=overlap)
    recorder = OpsOutsideTheGraph()
    recorder.watch(engine)
    with recorder:
        graphed = generate(engine, reqs)
    assert graphed == eager and len(eager) == 7

    graphs = engine.runner.graphs
    steps = [c for c in recorder.calls if c.replayed]
    assert len(steps) > 20 and all(c.replayed == 1 for c in steps) and sum(graphs.replayed.values()) == len(steps)
    assert {c.kind for c in steps} == ({"run", "launch"} if overlap == "on" else {"run"})
    assert all(graphs.replayed[size] > 0 for size in graphs.sizes)  # every bucket, most of them padded
    # a plain step: the one copy of the inputs; a launched one also copies its tokens to the host, to be read a
    # step later (on CUDA a non-blocking copy into pinned memory), and nothing more
    for c in steps:
        names = [name for name, _, _ in c.ops]
        assert names == (["copy_", "to"] if c.kind == "launch" else ["copy_"]), (c.kind, names)

    inputs, tokens = graphs.inputs, engine.runner.decode_inputs.tokens
    assert inputs.copies == len(steps)
    for c in steps:
        _, (dst, src, *_), _ = c.ops[0]
        assert dst.untyped_storage().data_ptr() == inputs.buffer.untyped_storage().data_ptr()
        assert src.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in inputs.host_buffers}
        if c.kind == "launch":  # what goes to the host is the token buffer the graph or the sampler wrote
            _, (launched_tokens, *_), host = c.ops[1]
            assert launched_tokens.untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr()
            assert host.device.type == "cpu"


def test_static_inputs_take_the_padding_from_the_host_and_copy_the_buckets_prefix_only():
    static = StaticInputs(rows=4, max_blocks=3, device=torch.device("cpu"))
    v = static.views
    for name, value in PADDING.items():  # before any step every row is a padding row, as captured
        assert (getattr(v, name) == value).all(), name
    full = dict(input_ids=np.array([5, 6, 7]), positions=np.array([3, 4, 5]), slot_mapping=np.array([3, 20, 37]),
                prev=np.array([-1, 0, 2]), context_lens=np.array([4, 5, 6], dtype=np.int32),
                block_tables=np.array([[0, -1, -1], [1, 2, -1], [2, 3, 4]], dtype=np.int32))
    static.write(3, 4, **full)
    assert v.input_ids.tolist() == [5, 6, 7, 0] and v.prev.tolist() == [-1, 0, 2, -1]
    assert v.slot_mapping.tolist() == [3, 20, 37, -1] and v.context_lens.tolist() == [4, 5, 6, 0]
    assert v.block_tables[3].tolist() == [-1, -1, -1]
    # the int64 fields and the context lengths are copied whole, the block tables through the bucket's rows
    static.write(1, 1, **{name: value[:1] for name, value in full.items()})
    assert v.input_ids.tolist() == [5, 0, 0, 0] and v.block_tables[1:].tolist() == [[1, 2, -1], [2, 3, 4], [-1] * 3]
    assert static.turn == 0 and static.copies == 2  # the two host buffers took turns
    static.write(1, 2, **{name: value[2:] for name, value in full.items()})  # the first host buffer again
    assert v.input_ids.tolist() == [7, 0, 7, 0] and v.slot_mapping[1] == -1 and v.context_lens[1] == 0
    assert v.block_tables[:3].tolist() == [[2, 3, 4], [-1] * 3, [2, 3, 4]]
    with pytest.raises(ValueError, match="writes every input field"):
        static.write(1, 1, input_ids=np.array([1]))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_launched_steps_hand_their_tokens_on_between_graphed_and_eager_steps(source, temperature):
    """The token buffer a launched step writes is the one the next step reads, whichever of the two runs in a graph:
    every third decode step here finds no bucket and runs eagerly (as one with adapter rows does)."""
    reqs = requests(temperature)
    eager = generate(engine_for(source, graphed=False, overlap="off"), reqs)
    engine = engine_for(source, graphed=True, overlap="on")
    graphs, asked = engine.runner.graphs, []
    bucket = graphs.bucket
    graphs.bucket = lambda n: None if asked.append(n) or len(asked) % 3 == 0 else bucket(n)
    assert generate(engine, reqs) == eager
    assert 0 < sum(graphs.replayed.values()) < len(asked) and engine.overlap.launched > len(asked) // 2


def test_a_token_on_the_device_must_come_from_the_step_built_just_before():
    inputs = DecodeInputs(max_num_seqs=2, max_blocks_per_seq=2, block_size=4, device=torch.device("cpu"))
    a, b = (Sequence(name, [1, 2], SamplingParams(), 4) for name in "ab")
    for seq in (a, b):
        seq.block_table, seq.num_computed_tokens = [0], 1
    assert inputs.build([a, b]).prev.tolist() == [-1, -1]
    for seq in (a, b):
        seq.token_ids.append(PENDING)
        seq.num_computed_tokens += 1
    assert inputs.build([b, a]).prev.tolist() == [1, 0]  # each one's row in the step before
    c = Sequence("c", [3, PENDING], SamplingParams(), 4)
    c.block_table, c.num_computed_tokens = [1], 1
    with pytest.raises(RuntimeError, match="not in the step before"):
        inputs.build([c])
