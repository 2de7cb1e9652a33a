"""Which rollout replica serves each request of an agent's trajectory (a session).

    replica = router.route(session, turn, tokens)   # before the request is sent
    router.finished(replica, tokens)                # once it is answered, or lost
    router.lost(replica)                            # its process died: its sessions move

A session's turns go to the replica that served its last turn while that replica lives: the
replica's prefix cache holds the conversation so far, and the next turn's prompt is that
conversation plus a few tokens. A new session, or one whose replica died, goes to the live replica
with the fewest outstanding tokens (prompt and token budget of the requests it has in flight;
ties to the lowest rank), so one long conversation does not queue the others behind it.

`routes` records every request as it was routed, for the run's `router.jsonl`:

    {"session": "45-5", "turn": 1, "replica": 0, "moved": false}   # row 5 of the call seeded 45

`moved` marks a turn sent to another replica than the session's last one (its replica died; a
turn lost with its replica is routed again, and appears twice).
"""

from collections import Counter


class Router:
    def __init__(self, replicas: int):
        self.live = set(range(replicas))
        self.outstanding = Counter({replica: 0 for replica in range(replicas)})  # tokens in flight
        self.home: dict[str, int] = {}  # session -> the replica that served its last turn
        self.routes: list[dict] = []

    def route(self, session: str, turn: int, tokens: int) -> int:
        """The replica for the session's request of turn `turn`, of `tokens` (prompt + budget)."""
        if not self.live:
            raise RuntimeError("every rollout replica died: no replica is left to route a request to")
        home = self.home.get(session)
        replica = home if home in self.live else min(self.live, key=lambda r: (self.outstanding[r], r))
        moved = home is not None and home != replica
        self.routes.append({"session": session, "turn": turn, "replica": replica, "moved": moved})
        self.home[session] = replica
        self.outstanding[replica] += tokens
        return replica

    def finished(self, replica: int, tokens: int) -> None:
        self.outstanding[replica] -= tokens

    def lost(self, replica: int) -> None:
        """The replica's process died: no request goes to it until `restored`."""
        self.live.discard(replica)

    def restored(self, replicas: list[int]) -> None:
        """Replicas serving again (restarted, with the current weights)."""
        self.live |= set(replicas)

    def take_routes(self) -> list[dict]:
        """The routes recorded since the last call."""
        routes, self.routes = self.routes, []
        return routes
