"""Node address detection for the Slurm launch: loopback and link-local addresses are never
advertised, the interface routing to the head is chosen, IPv6 is bracketed in host:port."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.launch.node_address import (
    format_host_port,
    is_usable_remote_address,
    pick_advertised_address,
    source_address_toward,
    this_node_address,
)

SCRIPT = Path(__file__).resolve().parents[1] / "hybridflow" / "launch" / "node_address.py"


def test_format_host_port_brackets_ipv6_only():
    assert format_host_port("10.0.0.1", 6379) == "10.0.0.1:6379"
    assert format_host_port("node-1.cluster", 6379) == "node-1.cluster:6379"
    assert format_host_port("fd00::2", 6379) == "[fd00::2]:6379"
    assert format_host_port("[fd00::2]", 6379) == "[fd00::2]:6379"


@pytest.mark.parametrize(
    "address, usable",
    [
        ("127.0.1.1", False),  # Debian's /etc/hosts line for the hostname
        ("::1", False),
        ("169.254.3.4", False),
        ("fe80::1%eth0", False),
        ("0.0.0.0", False),
        ("10.1.2.3", True),
        ("192.0.2.2", True),
        ("fd00::2", True),
        ("2001:db8::5", True),
    ],
)
def test_usable_remote_addresses(address, usable):
    assert is_usable_remote_address(address) is usable


def test_pick_keeps_resolver_order_and_skips_unusable():
    assert pick_advertised_address(["127.0.1.1", "fe80::1", "fd00::2", "10.0.0.5"]) == "fd00::2"
    assert pick_advertised_address(["127.0.0.1", "::1"]) is None


def test_source_address_toward_loopback_is_loopback():
    assert source_address_toward("127.0.0.1") == "127.0.0.1"
    if socket.has_ipv6:
        try:
            assert source_address_toward("::1") == "::1"
        except OSError:
            pytest.skip("IPv6 loopback is not configured on this machine")


def test_this_node_address_is_reachable_from_this_node():
    address = this_node_address()
    assert is_usable_remote_address(address)
    # The route toward our own advertised address uses that same address.
    assert source_address_toward(address) == address
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((address, 0))  # an address of this node: a server can listen on it


def test_script_runs_by_path_without_the_package():
    # The Slurm scripts run it by path on every node before anything else is set up.
    done = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--toward", "127.0.0.1"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "127.0.0.1"
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--toward", "no-such-host.invalid"], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "no-such-host.invalid" in bad.stderr and "Traceback" not in bad.stderr
