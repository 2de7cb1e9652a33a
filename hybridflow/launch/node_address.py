"""The address other nodes reach this node at, and host:port formatting that handles IPv6.

A node with several interfaces (management Ethernet, InfiniBand IPoIB, docker bridges) and a
hostname that may resolve to loopback (Debian's `127.0.1.1 host` line) needs care: the head
advertises the first non-loopback, non-link-local address its hostname resolves to (what the
other nodes resolve too), falling back to the interface of the default route; a worker advertises
the address of the interface that routes to the head, so both ends use the same network.

    python -m hybridflow.launch.node_address                   # this node's address
    python -m hybridflow.launch.node_address --toward HEAD     # address of the interface routing to HEAD
"""

import argparse
import ipaddress
import socket
import sys

# Never contacted: a UDP connect only asks the kernel which source address the route would use.
_DEFAULT_ROUTE_PROBES = ("192.0.2.1", "2001:db8::1")  # documentation ranges (RFC 5737, RFC 3849)
_PROBE_PORT = 9


def format_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (`[fd00::2]:6379`)."""
    if host.startswith("["):
        return f"{host}:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_usable_remote_address(address: str) -> bool:
    """True for an address another node could reach: not loopback, link-local or unspecified."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def pick_advertised_address(candidates: list[str]) -> str | None:
    """The first usable address in resolver order (which already applies RFC 6724 / gai.conf)."""
    usable = [a for a in candidates if is_usable_remote_address(a)]
    return usable[0] if usable else None


def resolve_all(host: str) -> list[str]:
    """Every address `host` resolves to, in resolver order, without duplicates (like `getent ahosts`)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def source_address_toward(target: str) -> str:
    """The local address of the interface the kernel routes `target` (address or hostname) through."""
    try:
        resolved = socket.getaddrinfo(target, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        raise OSError(f"cannot resolve {target!r}: {error.strerror}") from None
    errors = []
    for family, _, _, _, sockaddr in resolved:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
            except OSError as error:  # no route in this family: try the next resolved address
                errors.append(f"{sockaddr[0]}: {error}")
                continue
            return probe.getsockname()[0]
    raise OSError(f"no route from this node to {target!r} ({'; '.join(errors)})")


def this_node_address() -> str:
    """This node's address for other nodes: its hostname's first usable address, else the default route's."""
    hostname = socket.gethostname()
    try:
        chosen = pick_advertised_address(resolve_all(hostname))
    except socket.gaierror:
        chosen = None
    if chosen:
        return chosen
    for probe in _DEFAULT_ROUTE_PROBES:
        try:
            return source_address_toward(probe)
        except OSError:
            continue
    raise OSError(
        f"hostname {hostname!r} resolves only to loopback/link-local addresses and this node has no "
        "default route: add the node's address to /etc/hosts or DNS"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--toward", help="print the address of the interface that routes to this host")
    args = parser.parse_args()
    try:
        if args.toward:
            print(source_address_toward(args.toward))
        else:
            print(this_node_address())
    except OSError as error:  # includes unresolvable names (socket.gaierror)
        print(f"node_address: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
