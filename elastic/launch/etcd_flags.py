"""The etcd TLS and authentication flags that every ``elastic`` verb talking to etcd shares."""

from __future__ import annotations

import argparse

from elastic.foundation.settings import EtcdSecurity


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """The TLS and authentication flags (etcdctl's names; each has an ELASTIC_ETCD_* twin)."""
    g = p.add_argument_group("etcd TLS and authentication (https:// URLs)")
    g.add_argument("--etcd-cacert", metavar="FILE",
                   help="CA bundle that verifies etcd's certificate (default: the system's; "
                        "ELASTIC_ETCD_CACERT)")
    g.add_argument("--etcd-cert", metavar="FILE",
                   help="client certificate for mutual TLS (ELASTIC_ETCD_CERT)")
    g.add_argument("--etcd-key", metavar="FILE",
                   help="key of --etcd-cert (ELASTIC_ETCD_KEY)")
    g.add_argument("--etcd-user", metavar="NAME", help="etcd user (ELASTIC_ETCD_USER)")
    g.add_argument("--etcd-password-file", metavar="FILE",
                   help="file holding the user's password (or set ELASTIC_ETCD_PASSWORD; "
                        "never on the command line)")


def security_of(args: argparse.Namespace) -> EtcdSecurity:
    """The flags, then the ELASTIC_ETCD_* variables.

    Raises:
        ValueError: a file is missing, or half of a pair is.
    """
    return EtcdSecurity.resolve(cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
                                user=args.etcd_user, password_file=args.etcd_password_file)
