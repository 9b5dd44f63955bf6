"""The fleet's LoRA adapter registry (`{ns}:loras`): `kvgate loras`, the clients' add_lora/loras/remove_lora, and
`lora=` on submit refusing an adapter nobody registered."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.commands.cli import main
from kvgate.producer import AsyncClient, InvalidRequest
from kvgate.producer.keys import Keys
from kvgate.producer.loras import Lora


def _cli(redis_url, namespace, *argv) -> int:
    return main([argv[0], "--redis-url", redis_url, "--namespace", namespace, *argv[1:]])


def test_the_loras_command_adds_lists_and_removes_adapters_and_refuses_bad_ones(redis_server, keys, capsys):
    url = redis_server.url
    assert _cli(url, keys.ns, "loras", "add", "customer-7", "/adapters/c7", "--base", "org/base") == 0
    assert "added adapter customer-7 of org/base" in capsys.readouterr().out
    assert _cli(url, keys.ns, "loras", "add", "customer-7", "/adapters/c7-v2", "--base", "org/base") == 0
    assert "updated adapter customer-7" in capsys.readouterr().out
    assert _cli(url, keys.ns, "loras", "add", "sql", "/adapters/sql", "--base", "org/base") == 0
    capsys.readouterr()
    assert _cli(url, keys.ns, "loras") == 0
    assert capsys.readouterr().out.splitlines() == ["customer-7\torg/base\t/adapters/c7-v2",
                                                    "sql\torg/base\t/adapters/sql"]
    # an adapter is a model name of the fleet: the gateway accepts it and stats count its backlog
    assert redis_server.client().smembers(keys.models()) == {b"customer-7", b"sql"}
    assert _cli(url, keys.ns, "loras", "add", "two words", "/a", "--base", "org/base") == 2
    assert "name='two words'" in capsys.readouterr().err
    assert _cli(url, keys.ns, "loras", "add", "x", "/a") == 2
    assert "--base MODEL" in capsys.readouterr().err
    assert _cli(url, keys.ns, "loras", "add", "org/base", "/a", "--base", "org/base") == 2
    assert "differ from its base" in capsys.readouterr().err
    assert _cli(url, keys.ns, "loras", "remove", "sql") == 0
    assert _cli(url, keys.ns, "loras", "remove", "sql") == 1
    assert "no adapter 'sql'" in capsys.readouterr().err
    assert redis_server.client().smembers(keys.models()) == {b"customer-7"}
    assert sorted(redis_server.client().hkeys(keys.loras())) == [b"customer-7", b"sql"]  # sql: a tombstone
    assert _cli(url, keys.ns, "loras") == 0
    assert capsys.readouterr().out.splitlines() == ["customer-7\torg/base\t/adapters/c7-v2"]
    assert _cli(url, keys.ns, "loras", "add", "sql", "/adapters/sql2", "--base", "org/base") == 0
    assert "added adapter sql" in capsys.readouterr().out  # registered again over its tombstone


def test_the_client_registers_lists_and_removes_adapters(client):
    assert client.add_lora("c1", "/adapters/c1", "org/base") is True
    assert client.add_lora("c1", "/adapters/c1b", "org/base") is False
    assert client.loras() == {"c1": Lora("c1", "/adapters/c1b", "org/base")}
    with pytest.raises(InvalidRequest, match="path"):
        client.add_lora("c2", "", "org/base")
    assert client.remove_lora("c1") is True and client.remove_lora("c1") is False
    assert client.loras() == {}


def test_a_job_for_a_registered_adapter_goes_on_its_own_stream_and_an_unknown_one_is_refused(client, redis_server,
                                                                                              keys):
    r = redis_server.client()
    client.add_lora("c1", "/adapters/c1", "org/base")
    handle = client.submit("hi", lora="c1")
    assert r.xlen(keys.jobs("c1", "normal")) == 1 and handle.job_id
    client.submit("hi", model="c1")  # as OpenAI clients name it
    assert r.xlen(keys.jobs("c1", "normal")) == 2
    with pytest.raises(InvalidRequest) as err:
        client.submit("hi", lora="nobody")
    assert err.value.field == "lora" and "kvgate loras add" in str(err.value)
    with pytest.raises(InvalidRequest, match="adapter of 'org/base'"):
        client.submit("hi", lora="c1", model="other")
    assert r.xlen(keys.jobs("nobody", "normal")) == 0 and r.xlen(keys.jobs("other", "normal")) == 0


def test_the_async_client_refuses_an_unknown_adapter_and_submits_to_a_registered_one(redis_server, keys):
    async def main_():
        async with AsyncClient(redis_server.url, keys.ns) as c:
            assert await c.add_lora("c1", "/adapters/c1", "org/base")
            await c.submit("hi", lora="c1")
            with pytest.raises(InvalidRequest, match="no LoRA adapter"):
                await c.submit("hi", lora="c9")
            assert list(await c.loras()) == ["c1"]
            assert await c.remove_lora("c1")

    asyncio.run(main_())
    assert redis_server.client().xlen(keys.jobs("c1", "normal")) == 1


def test_the_registry_key_is_in_shard_0_under_its_hash_tag_on_a_cluster():
    keys = Keys("ns", shards=4, cluster=True)
    assert keys.loras() == keys.models().replace(":models", ":loras") and "{" in keys.loras()
    assert Keys("ns").loras() == "ns:loras"
