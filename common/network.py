"""This host's network, as the launcher and the ranks both need it: an
interface's address, the address that reaches another host, and a port to
listen on that no other program takes by chance."""
import fcntl
import random
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_address(name):
    """The IPv4 address of interface `name` (or `name` itself if it is one)."""
    try:
        socket.inet_aton(name)
        return name
    except OSError:
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        raise SystemExit("unisonrun: --network-interface %s: this host has no interface of that name with an "
                         "IPv4 address" % name)
    finally:
        probe.close()


def route_source(toward):
    """The address this machine uses to reach `toward`."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(toward), 9))
        return probe.getsockname()[0]
    except OSError as e:
        raise SystemExit("unisonrun: cannot tell which address of this machine reaches %s (%s); name the "
                         "interface the ranks should use with --network-interface" % (toward, e))
    finally:
        probe.close()


def ephemeral_ports():
    """The ports this machine's kernel picks by itself, for a connect() and
    for a bind() to port 0 (Linux's ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def bind_a_port_nobody_takes_by_chance(address):
    """A socket bound to `address` on a port that is free now and that the
    kernel never hands out by itself: one outside its ephemeral range.

    A rendezvous port goes unheld at times: between the launcher's choice
    and rank 0's listen, and between a shutdown() and the next init(). A
    port from the ephemeral range can be taken meanwhile by any connection
    or port-0 bind on the host, which CI once saw as rank 0's second init()
    failing with "Address already in use". Outside that range, only a
    program that names the port can take it. Falls back to a port-0 bind
    where the kernel's range leaves nothing outside it."""
    low, high = ephemeral_ports()
    # Below 10000 live many well-known services; stay above it where the
    # range leaves room.
    floor = 10000 if low > 20000 else 1024
    outside = list(range(floor, low)) + list(range(high + 1, 65536))
    chance = random.SystemRandom()  # not the user's seeded `random`: workers must not pick alike
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for port in chance.sample(outside, min(64, len(outside))) + [0]:
            try:
                probe.bind((address, port))
                return probe
            except OSError:
                if port == 0:
                    raise
    except BaseException:
        probe.close()
        raise


def a_port_nobody_takes_by_chance(address):
    """The number of a port on `address` that is free now and outside the
    kernel's ephemeral range, for a listener that another process starts
    later (rank 0's rendezvous): held by nobody meanwhile, but taken only by
    a program that names it."""
    with bind_a_port_nobody_takes_by_chance(address) as probe:
        return probe.getsockname()[1]


def is_this_machine(host):
    """True when `host` names this machine: an address of it can be bound."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((address, 0))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def one_interface(nics, caller):
    """The network interface a job's TCP plane uses, from Horovod's `nics`
    (a name, or a collection of one name), or None. unison's TCP plane runs
    over one interface, so more are refused, naming the caller."""
    if nics is None:
        return None
    names = [nics] if isinstance(nics, str) else sorted(nics)
    if len(names) != 1:
        raise ValueError("%s: nics=%r: unison's TCP plane runs over one network interface; name one (or none, "
                         "for the route the system picks)" % (caller, nics))
    return names[0]
