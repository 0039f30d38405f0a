"""The prefix tree: which pages of a prefix live on which tier, refs and locks, policy order,
victim choice and integrity checks. Bookkeeping only: it never allocates, frees, copies, waits
or touches storage."""

from tiered_kv.tree.integrity import check_tree
from tiered_kv.tree.node import TreeNode
from tiered_kv.tree.policies import POLICIES, EvictionPolicy, make_policy
from tiered_kv.tree.tiered_tree import Released, TieredTree, TreeMatch
from tiered_kv.tree.victims import victims

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "Released",
    "TieredTree",
    "TreeMatch",
    "TreeNode",
    "check_tree",
    "make_policy",
    "victims",
]
