"""IdentityRoots: the tree's roots, one per request identity.

A request with an ``extra_key`` (a LoRA adapter, a cache salt, multimodal hashes) matches and
inserts below the root of its identity, named by the identity's chain prior
(``storage.keys.extra_key_prior``; b"" for none). That prior is the root's only digest, so the
pages below it chain from it: their digests, storage keys and state keys differ per identity
with no second code path. A root is registered only by a change (an insert, or ``node_at`` for a
caller about to add below it); a match under an unknown identity gets a fresh unregistered one.
A non-default root that loses its last child is dropped, so per-request salts cannot grow the
tree without bound.
"""

from __future__ import annotations

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.keys import DIGEST_BYTES
from tiered_kv.tree.node import TreeNode, walk


def bare_root(prior: bytes = b"") -> TreeNode:
    """A root: never evicted (``lock_ref`` 1), its pages chaining from ``prior``."""
    root = TreeNode()
    root.lock_ref = 1
    if prior:
        root.digests = [prior]
    return root


class IdentityRoots:
    def __init__(self) -> None:
        self.default = bare_root()
        self._by_prior: dict[bytes, TreeNode] = {b"": self.default}

    def get(self, prior: bytes, *, create: bool) -> TreeNode:
        """The root of identity ``prior`` (a new one, registered only if ``create``)."""
        root = self._by_prior.get(prior)
        if root is None:
            if not isinstance(prior, bytes) or len(prior) != DIGEST_BYTES:
                raise InvalidArgumentError(
                    f"prior={prior!r:.40} must be b'' or {DIGEST_BYTES} bytes (a request "
                    "identity's chain prior, storage.keys.extra_key_prior)"
                )
            root = bare_root(prior)
            if create:
                self._by_prior[prior] = root
        return root

    def adopt(self, prior: bytes, root: TreeNode) -> TreeNode:
        """``root`` registered for ``prior`` unless one already is; the registered one."""
        return self._by_prior.setdefault(prior, root)

    def drop_if_bare(self, node: TreeNode) -> None:
        """Forget ``node`` if it is a non-default root with no children left."""
        if node.parent is None and not node.children and node is not self.default:
            prior = node.last_digest()
            if self._by_prior.get(prior) is node:
                del self._by_prior[prior]

    def by_prior(self) -> dict[bytes, TreeNode]:
        return dict(self._by_prior)

    def walk(self):
        """Every node below every root (depth first, parents before children)."""
        for root in list(self._by_prior.values()):
            yield from walk(root)
