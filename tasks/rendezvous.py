"""The c10d store the nodes of a job rendezvous at, hosted by the orchestrator.

torchrun's c10d rendezvous needs one TCP store that every node's agent reaches. Hosted by
an agent (torchrun's default: the node whose host matches the endpoint), it dies with that
node, and the survivors' next rendezvous has nowhere to go. Hosted here, in the process that
outlives every attempt, it survives the loss of any node: each attempt rendezvous under its
own run id in the same store, and every agent joins as a client (``is_host=false``).

The store listens on all of this host's interfaces (torch's TCPStore binds no single one);
nodes reach it at ``address``: this host's advertised address (``ETT_ADVERTISE_ADDRESS``,
infra/node_protocol.py), or ``localhost`` for a job whose nodes all run here.
"""

from __future__ import annotations

import datetime

STORE_TIMEOUT = datetime.timedelta(minutes=15)  # a client's wait for a key (the rendezvous)


class RendezvousHost:
    """A c10d TCP store on a free port of this host; ``endpoint`` is what the nodes join."""

    def __init__(self, address: str) -> None:
        from torch.distributed import TCPStore  # torch only for a job of several nodes

        self.address = address
        self._store: TCPStore | None = TCPStore(
            host_name=address,
            port=0,  # the OS picks a free one
            is_master=True,
            wait_for_workers=False,
            timeout=STORE_TIMEOUT,
        )
        self.port = int(self._store.port)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    def close(self) -> None:
        """Stop serving (the store's server thread ends with its last reference)."""
        self._store = None

    def __enter__(self) -> RendezvousHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
