"""A worker's side of tool calling with the simulated engine (its template, like SmolLM2's, renders no tools): an
`auto` job is served with the fallback prompt and its deltas name the format its calls are read in, and a forged job
whose tools are bad is an error result naming them while the worker serves the next job (invariants 3 and 8)."""
from __future__ import annotations

from kvgate.producer.constraints import Function, Tools
from kvgate.producer.protocol import Delta, Message, ToolCall, encode

TOOLS = Tools([Function("get_weather", "The weather", '{"type":"object","properties":{"city":{"type":"string"}}}')])
ASK = [Message("user", "Weather in Paris?")]


def test_an_auto_job_streams_deltas_that_name_its_parser_and_ends_with_one_final(queue, thread_worker):
    with thread_worker(tool_call_parser="llama3"):
        job_id = queue.submit(messages=ASK, tools=TOOLS, max_tokens=6, ignore_eos=True, stream=True)
        plain = queue.submit(messages=ASK, max_tokens=3, ignore_eos=True, stream=True)
        finals = {f.job_id: f for f in queue.wait_finals(2)}
    final = finals[job_id]
    assert final.status == "done" and final.tool_calls is None and final.content is None  # its text is no call
    deltas = [e for e in queue.events() if isinstance(e, Delta)]
    assert {d.tool_parser for d in deltas if d.job_id == job_id} == {"llama3"}  # --tool-call-parser wins
    assert {d.tool_parser for d in deltas if d.job_id == plain} == {None}
    # the fallback prompt made it longer than the same conversation without tools
    assert final.usage.prompt_tokens > finals[plain].usage.prompt_tokens


def test_a_forged_job_with_bad_tools_is_an_error_result_and_the_worker_serves_the_next(queue, thread_worker):
    with thread_worker():
        bad = queue.job(messages=ASK, tools=Tools([Function("rm -rf /")]))
        queue.xadd(encode(bad))
        history = [*ASK, Message("tool", "sunny", tool_call_id="call_1")]
        good = queue.submit(messages=history, tools=TOOLS, max_tokens=2, ignore_eos=True)
        finals = {f.job_id: f for f in queue.wait_finals(2)}
    assert finals[bad.job_id].status == "error" and "tool name 'rm -rf /'" in finals[bad.job_id].error
    assert finals[good].status == "done"


def test_a_tokenize_job_counts_a_tool_conversation_as_its_generation_job_is_given_it(queue, thread_worker):
    history = [*ASK, Message("assistant", "", [ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
               Message("tool", "sunny", tool_call_id="call_1")]
    with thread_worker():
        counted = queue.submit(messages=history, task="tokenize")
        generated = queue.submit(messages=history, max_tokens=1, ignore_eos=True)
        finals = {f.job_id: f for f in queue.wait_finals(2)}
    # the call and the tool's answer are in both, as hermes text (this template renders no tools)
    assert len(finals[counted].token_ids) == finals[generated].usage.prompt_tokens
    plain = [m for m in history if m.role == "user"]
    with thread_worker():
        bare = queue.submit(messages=plain, task="tokenize")
        (final,) = [f for f in queue.wait_finals(3) if f.job_id == bare]
    assert len(final.token_ids) < len(finals[counted].token_ids)
