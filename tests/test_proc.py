"""arealite/utils/proc.py: the free-port helper and children that die with their parent."""

import socket

import pytest

from arealite.utils.proc import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_can_be_bound_on_the_host_it_was_asked_for(host):
    port = free_port(host)
    assert 1024 <= port <= 65535
    with socket.socket() as s:  # free on that address right after the call
        s.bind((host, port))
        assert s.getsockname()[1] == port


def test_free_port_of_a_foreign_address_raises():
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: not an address of this machine
