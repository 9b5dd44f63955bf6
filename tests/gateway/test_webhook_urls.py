"""Webhook URLs are checked at start (issue 44): http or https only; private, loopback and link-local addresses refused
unless --webhook-allow-private; never the gateway's own listen address; secrets in the Standard Webhooks form. Each
refusal names the value and what to do; a secret is never shown."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import subprocess
import sys

import pytest
from pydantic import ValidationError

from kvgate.gateway.settings import GatewaySettings
from tests.gateway.webhook_receiver import new_secret
from tests.support import ROOT

SECRET = new_secret()
PUBLIC = "http://93.184.215.14/hooks"  # a global address, given as one: no DNS needed


def refusal(**settings) -> str:
    with pytest.raises(ValidationError) as e:
        GatewaySettings(**settings)
    return str(e.value)


@pytest.mark.parametrize("url", ["ftp://93.184.215.14/x", "file:///etc/passwd", "93.184.215.14/hooks", "http:///x",
                                 "gopher://example.com/"])
def test_a_webhook_url_that_is_not_http_or_https_is_refused(url):
    message = refusal(webhook_url=url, webhook_secret=SECRET)
    assert repr(url) in message and "must be an http:// or https:// URL" in message


@pytest.mark.parametrize("url, address", [
    ("http://10.1.2.3/h", "10.1.2.3"), ("http://192.168.0.7:8080/h", "192.168.0.7"), ("https://172.16.5.4/h",
                                                                                      "172.16.5.4"),
    ("http://127.0.0.1:9/h", "127.0.0.1"), ("http://[::1]:9/h", "::1"), ("http://169.254.169.254/latest/meta-data",
                                                                         "169.254.169.254"),
    ("http://[fe80::1]/h", "fe80::1"), ("http://[fd00::5]/h", "fd00::5"), ("http://0.0.0.0:9/h", "0.0.0.0"),
    ("http://[::ffff:10.0.0.1]/h", "::ffff:10.0.0.1"), ("http://localhost:9/h", "127.0.0.1")])
def test_a_private_loopback_or_link_local_webhook_url_is_refused_unless_allowed(url, address):
    message = refusal(webhook_url=url, webhook_secret=SECRET)
    assert repr(url) in message and address in message and "--webhook-allow-private" in message
    assert SECRET not in message
    if address != "0.0.0.0":  # the unspecified address is "here" on every port: refused always (below)
        assert GatewaySettings(webhook_url=url, webhook_secret=SECRET, webhook_allow_private=True).webhook_url == url


@pytest.mark.parametrize("url, host", [("http://127.0.0.1:8000/h", "127.0.0.1"), ("http://localhost:8000/h",
                                                                                  "127.0.0.1"),
                                       ("http://127.0.0.1:8000/h", "0.0.0.0"), ("http://[::1]:8000/h", "::"),
                                       ("http://0.0.0.0:8000/h", "127.0.0.1")])
def test_a_webhook_url_pointing_at_the_gateway_itself_is_refused_even_when_private_is_allowed(url, host):
    message = refusal(webhook_url=url, webhook_secret=SECRET, webhook_allow_private=True, host=host, port=8000)
    assert repr(url) in message and "points at this gateway itself" in message


def test_a_loopback_url_on_another_port_than_the_gateway_is_taken_when_private_is_allowed():
    s = GatewaySettings(webhook_url="http://127.0.0.1:8001/h", webhook_secret=SECRET, webhook_allow_private=True,
                        port=8000)
    assert s.webhook_targets().of("anyone").url == "http://127.0.0.1:8001/h"


def test_a_public_address_is_taken_without_allowing_private_ones():
    assert GatewaySettings(webhook_url=PUBLIC, webhook_secret=SECRET).webhook_targets().default.url == PUBLIC


def test_a_host_that_does_not_resolve_is_refused_naming_it():
    message = refusal(webhook_url="https://no-such-host.invalid/h", webhook_secret=SECRET)
    assert "'no-such-host.invalid' does not resolve" in message


@pytest.mark.parametrize("secret", ["", "abc", "whsec_", "whsec_not base64!", "whsec_" + "QUJD", "sk-123"])
def test_a_secret_not_in_the_standard_webhooks_form_is_refused_without_showing_it(secret):
    message = refusal(webhook_url=PUBLIC, webhook_secret=secret)
    assert "--webhook-secret must be whsec_ followed by the base64" in message
    assert secret in ("", "whsec_") or secret not in message


@pytest.mark.parametrize("given", [dict(webhook_url=PUBLIC), dict(webhook_secret=SECRET)])
def test_a_webhook_url_without_a_secret_or_a_secret_without_a_url_is_refused(given):
    assert "--webhook-url and --webhook-secret go together" in refusal(**given)


@pytest.mark.parametrize("entry, says", [
    ('url = "http://10.0.0.1/h"\nsecret = "{s}"', "[tenants.team-a] url 'http://10.0.0.1/h': resolves to 10.0.0.1"),
    ('url = "ftp://93.184.215.14/"\nsecret = "{s}"', "must be an http:// or https:// URL"),
    ('url = "http://93.184.215.14/h"', "must hold exactly url and secret"),
    ('url = "http://93.184.215.14/h"\nsecret = "whsec_x"', "[tenants.team-a] secret must be whsec_"),
    ('url = "http://93.184.215.14/h"\nsecret = "{s}"\nretries = 3', "must hold exactly url and secret")])
def test_a_bad_entry_in_the_webhooks_file_stops_the_start_naming_the_file_and_the_tenant(tmp_path, entry, says):
    path = tmp_path / "webhooks.toml"
    path.write_text("[tenants.team-a]\n" + entry.format(s=SECRET) + "\n")
    message = refusal(webhooks_file=str(path))
    assert f"webhooks file {path}" in message and says in message and SECRET not in message


def test_kvgate_serve_refuses_a_link_local_webhook_url_in_one_line_naming_it():
    out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "serve", "--webhook-url",
                          "http://169.254.169.254/latest", "--webhook-secret", SECRET], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "--webhook-url 'http://169.254.169.254/latest'" in line and "--webhook-allow-private" in line
    assert SECRET not in line


@pytest.mark.parametrize("url, connect, host, sni", [
    ("https://hooks.example.com/k?x=1", "https://127.0.0.1/k?x=1", "hooks.example.com", "hooks.example.com"),
    ("http://u:p@hooks.example.com:8080/k", "http://u:p@127.0.0.1:8080/k", "hooks.example.com:8080", None),
    ("http://[::1]:9/k", "http://[::1]:9/k", "[::1]:9", None)])
def test_a_delivery_route_names_the_checked_address_and_keeps_the_host_for_the_header_and_tls(url, connect, host, sni,
                                                                                              monkeypatch):
    from kvgate.gateway.webhooks import targets

    monkeypatch.setattr(targets, "_addresses", lambda h, port: [ipaddress.ip_address("::1" if ":" in h else
                                                                                     "127.0.0.1")])
    way = targets.route(url, "--webhook-url", True, None)
    assert (way.url, way.headers, way.extensions) == (connect, {"host": host}, {"sni_hostname": sni} if sni else {})


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_delivery_goes_to_the_address_its_check_approved_when_the_name_resolves_elsewhere_later(shared_redis,
                                                                                                  namespace,
                                                                                                  monkeypatch, scheme):
    """DNS rebinding: the name answers a checked address once, then another; the POST must not look it up again. Over
    https the receiver's certificate is for the name, not the address: TLS is checked against the name (SNI)."""
    import httpx
    import trustme
    import redis.asyncio as aioredis

    from kvgate.gateway.webhooks.outbox import Outbox, WebhookKeys
    from kvgate.gateway.webhooks.sender import Timing, WebhookSender
    from kvgate.gateway.webhooks.targets import Listen, Target, Targets
    from tests.gateway.test_webhook_outbox import add
    from tests.gateway.webhook_receiver import Receiver

    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hooks.rebind.test").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    receiver = Receiver(tls=server_tls if scheme == "https" else None).start()
    real, looked_up, counted = socket.getaddrinfo, [], []

    def rebinding(host, *args, **kwargs):
        if host != "hooks.rebind.test":
            return real(host, *args, **kwargs)
        looked_up.append(host)
        if len(looked_up) > 1:  # where it points now is not where the check looked
            raise socket.gaierror(socket.EAI_NONAME, "hooks.rebind.test points elsewhere now")
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    url = f"{scheme}://hooks.rebind.test:{receiver.port}/hooks"

    async def deliver_one():
        r = aioredis.Redis.from_url(shared_redis.url)
        try:
            outbox = Outbox(r, WebhookKeys(namespace))
            await add(outbox, r)
            sender = WebhookSender(outbox, Targets(Target(url, SECRET)), Timing(60, 1, 5, 0.05), allow_private=True,
                                   listen=Listen("127.0.0.1", 1), ended=None, count=counted.append)
            now_ms, (event,) = await outbox.claim(1, 10_000)
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=client_tls) as http:
                await sender._deliver(http, event, now_ms)
        finally:
            await r.aclose()

    try:
        asyncio.run(deliver_one())
    finally:
        receiver.stop()
    assert counted == ["delivered"] and looked_up == ["hooks.rebind.test"]
    assert receiver.deliveries[0].headers["host"] == f"hooks.rebind.test:{receiver.port}"
