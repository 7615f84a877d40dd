"""The cache daemon: the server and its accept loop (server.py), one
connection's life (conn.py) and its operations (ops.py), the wire protocol
(protocol.py), shared-memory bulk transfer (shm.py), tenants, re-keying,
quotas and the key secret's file (tenants.py), the bounds on peers
(limits.py), /metrics and /health (metrics.py), its sections of the config
tree (config.py), and the client other processes use (client.py)."""
