"""`kvgate bench structured`: W-STRUCT (issue 25). W-CPU's requests on the bundled model, each with a JSON schema of
realistic size (an object of 8 typed fields), against the same requests unconstrained, same engine, same run, at each
batch size; the mask's cost on the engine thread per step; a schema's compile time, fresh and cached, for llguidance
(the engine's) beside xgrammar where it is installed; and the mask of a 256-row batch (W-HOST's batch) on its own."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kvgate.commands.flags import setting_parser

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "city", "tags", "score", "active", "kind"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "kind": {"enum": ["person", "company", "other"]},
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--model", default="smollm2-135m", help="the model (default: the bundled SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per run (W-CPU: 64)")
    parser.add_argument("--max-prompt", type=int, default=128, help="prompt lengths uniform in [16, this]")
    parser.add_argument("--max-output", type=int, default=256, help="max_tokens uniform in [160, this] (a "
                        "constrained answer ends where its JSON does)")
    parser.add_argument("--batch", type=int, action="append", help="max_num_seqs to run at (repeatable; 32 and 64)")
    parser.add_argument("--host-batch", type=int, default=256, help="rows of the mask-only measure (W-HOST's 256)")
    parser.add_argument("--device", type=setting_parser("device"), default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvgate.bench.report import machine_info, versions
    from kvgate.engine.loader import resolve_model
    from kvgate.engine.model_runner import resolve_device

    device = resolve_device(args.device)
    source = resolve_model(args.model, seed=args.seed)
    rng = random.Random(args.seed)
    vocab = source.config.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(16, max(16, args.max_prompt)))],
                 rng.randint(min(160, args.max_output), args.max_output)) for _ in range(args.num_requests)]
    report = {"workload": "W-STRUCT", "machine": machine_info(device), "versions": versions() | _grammar_versions(),
              "settings": {"model": args.model, "num_requests": args.num_requests, "device": str(device),
                           "prompts": "random token ids (seed shared by both runs)", "sampling": "greedy",
                           "schema_fields": len(SCHEMA["properties"])},
              "compile": compile_figures(source.tokenizer, vocab), "runs": {}}
    print(json.dumps(report["compile"], indent=2))
    for batch in args.batch or [32, 64]:
        figures = run_batch(source, requests, batch, device)
        report["runs"][str(batch)] = figures
        print(f"batch {batch}: {json.dumps(figures)}")
    report["host_mask"] = host_mask_figures(source.tokenizer, vocab, args.host_batch, device)
    print(f"mask only, batch {args.host_batch}: {json.dumps(report['host_mask'])}")
    torch.set_num_threads(torch.get_num_threads())
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _grammar_versions() -> dict:
    import importlib.metadata

    out = {}
    for name in ("llguidance", "xgrammar"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def compile_figures(tokenizer, vocab: int) -> dict:
    """Milliseconds: the vocabulary's preparation (once per worker), the schema's compile, and a cached one."""
    from kvgate.engine.constraints import Grammars, StructuredOutput

    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_token_id})
    start = time.perf_counter()
    grammars.tokenizer_future().result()
    prepare = time.perf_counter() - start
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))

    def compiled() -> float:
        start = time.perf_counter()
        future = grammars.compile(constraint)
        while grammars.ready(future) is None:
            time.sleep(0.0002)
        return time.perf_counter() - start

    fresh, cached = compiled(), statistics.median(compiled() for _ in range(20))
    grammars.close()
    out = {"llguidance": {"vocabulary_ms": prepare * 1e3, "compile_ms": fresh * 1e3, "cached_ms": cached * 1e3}}
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    prepare = time.perf_counter() - start
    compiler = xgr.GrammarCompiler(info)
    start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA))
    fresh = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA))
    out["xgrammar"] = {"vocabulary_ms": prepare * 1e3, "compile_ms": fresh * 1e3,
                       "cached_ms": (time.perf_counter() - start) * 1e3}
    return out


def run_batch(source, requests, batch: int, device) -> dict:
    """The runs on one engine, unconstrained first, then constrained with and without jump-forward: output tok/s,
    steps, the mask's time on the engine thread per step that had a constrained row, and how many constrained
    answers validate."""
    import jsonschema

    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.sampler import Sampler

    llm = LLM(source, device=str(device), max_num_seqs=batch, max_model_len=128 + 256 + 8, seed=0)
    llm.generate([requests[0][0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    prompts = [p for p, _ in requests]
    constraint = {"kind": "json_schema", "spec": json.dumps(SCHEMA)}
    out = {}
    mask_times: list[float] = []
    original = Sampler.mask

    def timed(self, logits, seqs, rows):
        start = time.perf_counter()
        original(self, logits, seqs, rows)
        mask_times.append(time.perf_counter() - start)

    Sampler.mask = timed
    try:
        for name, structured, jump in (("unconstrained", None, True), ("constrained", constraint, True),
                                       ("constrained_no_jump_forward", constraint, False)):
            llm.engine.config.jump_forward = jump
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=structured is None,
                                     structured=structured) for _, n in requests]
            mask_times.clear()
            steps, start = llm.engine.steps, time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outputs)
            figures = {"output_tokens": tokens, "seconds": wall, "output_tok_s": tokens / wall,
                       "steps": llm.engine.steps - steps}
            if structured is not None:
                valid = 0
                for o in outputs:
                    try:
                        jsonschema.validate(json.loads(o.text), SCHEMA)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
                figures |= {"valid": valid, "answers": len(outputs),
                            "finished_stop": sum(o.finish_reason == "stop" for o in outputs),
                            "mask_ms_per_step_median": statistics.median(mask_times) * 1e3,
                            "mask_ms_per_step_p90": sorted(mask_times)[int(0.9 * (len(mask_times) - 1))] * 1e3,
                            "masked_steps": len(mask_times)}
            out[name] = figures
    finally:
        Sampler.mask = original
    out["constrained/unconstrained_tok_s"] = out["constrained"]["output_tok_s"] / out["unconstrained"]["output_tok_s"]
    # jump-forward: the same constrained requests with a forward per token; steps are exact, seconds are the machine's
    out["jump_forward_steps_saved"] = 1 - out["constrained"]["steps"] / out["constrained_no_jump_forward"]["steps"]
    out["jump_forward_tok_s_ratio"] = (out["constrained"]["output_tok_s"]
                                       / out["constrained_no_jump_forward"]["output_tok_s"])
    return out


def host_mask_figures(tokenizer, vocab: int, rows: int, device) -> dict:
    """The mask of `rows` matchers part-way into the schema's JSON: fill (llguidance's executor) and apply, ms."""
    import torch

    from kvgate.engine.constraints import Grammars, StructuredOutput, TokenMasks

    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_token_id})
    future = grammars.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    while (first := grammars.ready(future)) is None:
        time.sleep(0.001)
    prefix = tokenizer.encode('{"name": "Ada", "age": 36, "email": "ada@', add_special_tokens=False)
    matchers = [first] + [grammars.ready(future) for _ in range(rows - 1)]
    for m in matchers:
        m.consume_tokens(prefix)
    masks = TokenMasks(vocab)
    logits = torch.randn(rows, vocab, device=device)
    fills, applies = [], []
    for _ in range(20):
        start = time.perf_counter()
        bitmask = masks.fill(matchers)
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        masks.apply(logits, list(range(rows)), bitmask)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        applies.append(time.perf_counter() - start)
    grammars.close()
    return {"rows": rows, "fill_ms": statistics.median(fills) * 1e3, "apply_ms": statistics.median(applies) * 1e3}
