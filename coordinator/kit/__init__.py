"""The fleet kit: everything a secure deployment of one run needs, generated in one directory.

Security is enforced by the broker (mosquitto >= 2.0), not by fedge: TLS, one random password per device, client ids
bound to user names (``use_username_as_clientid``) and a least-privilege ACL. The kit::

    <out>/broker/        mosquitto.conf, passwd (mosquitto's own $7$ PBKDF2-SHA512 format), acl,
                         amqtt-passwd + acl.json (the same users and ACL for the embedded broker), ca.crt,
                         server.crt, server.key
    <out>/ca/            ca.crt, ca.key: the private CA; keep it offline, it is only needed to issue more certificates
    <out>/coordinator/   a bundle: bundle.json, password, ca.crt [, client.crt, client.key]
    <out>/monitor/       the same for ``fedge status``: a login that can only read the run status
    <out>/clients/<id>/  one bundle per client, to copy onto that device

A bundle is read with :func:`fedge_io.credentials.load_bundle`. User names are ``fedge-<run>-<client>`` and
``fedge-<run>-coordinator``, the MQTT client ids the roles have always used; the broker makes every connection's
client id its user name, so nobody can take over another device's connection.

Least privilege, per run: client X publishes only ``update/X`` and ``status/X`` (its hello and last will) and
reads only ``task/X`` and ``broadcast``; the coordinator publishes tasks, broadcasts and the run status and reads
updates, statuses and the broker's ``$SYS`` byte counters; the monitor reads the run status; nobody else reads or
writes anything under ``fedge/<run>/``.

Secrets come from :mod:`secrets`; every file holding one is created with mode 0600 (directories 0700), and no
secret is ever logged or put on a command line. Certificates (ECDSA P-256) are made with ``cryptography``.
"""
