"""Which network interface holds an address of this machine (Linux ``getifaddrs``).

torch's gloo and NCCL choose where to listen from ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` only (without them gloo takes whatever the host name resolves to, and
NCCL any interface). Tying both to the interface of the advertised address keeps every listener
of a worker on the network its peers use, on every code path (loopback, a cluster network, a
namespace's veth).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from collections.abc import Mapping

from elastic.foundation.errors import AdvertiseAddressError


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_uint8 * 14)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                ("flowinfo", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 16),
                ("scope_id", ctypes.c_uint32)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p),
                     ("flags", ctypes.c_uint), ("addr", ctypes.POINTER(_SockAddr)),
                     ("netmask", ctypes.POINTER(_SockAddr)), ("ifu", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def addresses() -> list[tuple[str, str]]:
    """Every (interface, address) of this machine's network namespace.

    Raises:
        OSError: ``getifaddrs`` failed.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr and item.addr.contents.family == socket.AF_INET:
                raw = bytes(item.addr.contents.data[2:6])  # after the port
                found.append((item.name.decode(), socket.inet_ntop(socket.AF_INET, raw)))
            elif item.addr and item.addr.contents.family == socket.AF_INET6:
                six = ctypes.cast(item.addr, ctypes.POINTER(_SockAddrIn6)).contents
                found.append((item.name.decode(),
                              socket.inet_ntop(socket.AF_INET6, bytes(six.addr))))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_of(address: str) -> str:
    """The name of the interface that holds ``address``.

    Raises:
        AdvertiseAddressError: no interface of this machine holds it.
    """
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        raise AdvertiseAddressError(
            f"the advertised address {address!r} is not an IP address: --advertise-addr / "
            "ELASTIC_ADVERTISE_ADDR must be an IP address of this machine.") from None
    for name, found in addresses():
        if ipaddress.ip_address(found.split("%")[0]) == wanted:
            return name
    raise AdvertiseAddressError(
        f"no network interface of this machine holds the advertised address {address}: "
        "--advertise-addr / ELASTIC_ADVERTISE_ADDR must be an address of this machine that the "
        "other workers can reach.")


def socket_interface_env(address: str, env: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for ``address``'s interface, for those
    of the two that ``env`` does not set already (an explicit choice wins).

    Raises:
        AdvertiseAddressError: no interface of this machine holds ``address``.
    """
    missing = [name for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in env]
    if not missing:
        return {}
    interface = interface_of(address)
    values = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}
    return {name: values[name] for name in missing}
