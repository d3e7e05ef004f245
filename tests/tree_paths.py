"""Reading a ddtree.Tree in the DDTree tests: the tokens on the path to a node, and a node's
children. Not a test file: the tests import from it."""
from tinydiff.ddtree import Tree


def prefix_of(tree: Tree, node: int) -> tuple:
    return tuple(int(tree.tokens[i]) for i in tree.path(node))


def children(tree: Tree, node: int) -> list[int]:
    return [i for i in range(1, tree.size + 1) if int(tree.parents[i]) == node]
