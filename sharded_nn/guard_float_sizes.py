"""A warning where a model's code puts a Python float on the left of a size read from a slab.

Sizes read from a slab under the forward guard are ints that remember they are local
(``LocalLength``): arithmetic on them stays tagged, and where a result is used as a value the
guard evaluates it on the global sizes. Python's float arithmetic reads an int operand's value
directly, with no hook an int subclass can take: ``0.01 * h``, ``2 * math.pi / n`` and
``1.0 / (h - 1)`` are plain local numbers, silently the slab's (the README, "Inside forward").
The guard cannot see such a number; it can read the code. When a sharded size is read at a line
of a model's forward, the function's source is parsed once (cached per code object and line):
the names that line binds to sharded sizes (``h = x.shape[2]``, ``b, c, h, w = x.shape``) and
the size expression itself are looked for on the right of a ``+ - * / // % **`` whose left
operand is a float (a float literal, ``math.pi``, ``math.e``, ``math.tau``, a name bound to one,
or arithmetic containing one), and each hit gives one ``ShardingWarning`` naming the line and
the fix (the size first: ``h * 0.01``, or ``float(h)``). A heuristic: names rebound later, sizes
passed to other functions and floats built elsewhere go unseen; it never changes a result.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings

from .errors import ShardingWarning

__all__ = ["warn_float_left_of_sizes"]

_FLOAT_ATTRS = {"pi", "e", "tau", "inf"}
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
#: The parse of each code object (each site is checked once: ``forward_guard._lint_float_sizes``).
_TREES: dict = {}


def _tree(code):
    """The function of ``code`` parsed (line numbers as in the file), or None."""
    if code in _TREES:
        return _TREES[code]
    tree = None
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(tree, start - 1)
    except (OSError, TypeError, SyntaxError, IndentationError):
        tree = None
    if len(_TREES) < 4096:
        _TREES[code] = tree
    return tree


def _is_size_read(node) -> bool:
    """``x.shape``, ``x.shape[...]``, ``x.size(...)``, ``x.numel()``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr == "shape":
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("size", "numel")


def _reads_sharded(node, positions: set[int], ndim: int) -> bool:
    """Whether a size read (``_is_size_read``) reads a sharded position: ``x.shape[1]`` or
    ``x.size(1)`` of an unsharded dim is the whole sample's size (a class count: no warning);
    an index that is not a constant is taken as one."""
    idx = None
    if isinstance(node, ast.Subscript):
        idx = node.slice
    elif isinstance(node, ast.Call) and node.func.attr == "size" and node.args:
        idx = node.args[0]
    if idx is None:
        return True  # ``x.shape``, ``x.size()``, ``x.numel()``
    try:
        if isinstance(idx, ast.Slice):
            lo = ast.literal_eval(idx.lower) if idx.lower is not None else None
            hi = ast.literal_eval(idx.upper) if idx.upper is not None else None
            return any(p in positions for p in list(range(ndim))[slice(lo, hi)])
        i = ast.literal_eval(idx)
    except ValueError:
        return True
    return not isinstance(i, int) or i % max(ndim, 1) in positions


def _sharded_names(stmt, positions: set[int], ndim: int) -> set[str]:
    """The names ``stmt`` binds to sizes of sharded positions (``positions`` of an ``ndim``-d
    tensor), from ``a, b, c, d = x.shape``, ``h = x.shape[2]``, ``h, w = x.shape[-2:]``, ``x.size(2)``."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return set()
    target, value = stmt.targets[0], stmt.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "numel":
        return {target.id} if isinstance(target, ast.Name) else set()  # ``n = x.numel()``: a slab's count
    idx = None
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Attribute) and value.value.attr == "shape":
        idx = value.slice
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "size":
        idx = value.args[0] if value.args else ast.Slice(None, None, None)
    elif isinstance(value, ast.Attribute) and value.attr == "shape":
        idx = ast.Slice(None, None, None)
    if idx is None:
        return set()
    if isinstance(idx, ast.Slice):
        try:
            lo = ast.literal_eval(idx.lower) if idx.lower is not None else None
            hi = ast.literal_eval(idx.upper) if idx.upper is not None else None
        except ValueError:
            return set()
        picked = list(range(ndim))[slice(lo, hi)]
        if isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == len(picked):
            return {t.id for t, p in zip(target.elts, picked) if isinstance(t, ast.Name) and p in positions}
        return set()
    try:
        i = ast.literal_eval(idx)
    except ValueError:
        return set()
    if isinstance(i, int) and isinstance(target, ast.Name) and i % max(ndim, 1) in positions:
        return {target.id}
    return set()


def _floaty(node, floats: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, float)
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id in ("math", "np", "numpy", "torch") and (
            node.attr in _FLOAT_ATTRS)
    if isinstance(node, ast.Name):
        return node.id in floats
    if isinstance(node, ast.BinOp):
        return _floaty(node.left, floats) or _floaty(node.right, floats)
    if isinstance(node, ast.UnaryOp):
        return _floaty(node.operand, floats)
    return False


def _mentions(node, names: set[str], line: int, positions: set[int], ndim: int) -> bool:
    """Whether ``node`` uses a sharded size as an int: not inside a call (``float(h)``,
    ``int(h)`` and ``math.sqrt(h)`` give the global number under the guard)."""
    if getattr(node, "lineno", None) == line and _is_size_read(node):
        return _reads_sharded(node, positions, ndim)
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Call):
        return False
    return any(_mentions(c, names, line, positions, ndim) for c in ast.iter_child_nodes(node))


def warn_float_left_of_sizes(frame, positions: set[int], ndim: int) -> None:
    """Warn where the code of ``frame`` (a model's forward that just read sizes of
    the sharded ``positions`` of an ``ndim``-d slab at its current line) puts a float on their left."""
    code, line = frame.f_code, frame.f_lineno
    tree = _tree(code)
    if tree is None:
        return
    stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and getattr(n, "lineno", 0) == line]
    names = set()
    for s in stmts:
        names |= _sharded_names(s, positions, ndim)
    floats = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _floaty(n.value, set())
              for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(tree):
        if not (isinstance(n, ast.BinOp) and isinstance(n.op, _OPS)):
            continue
        if getattr(n, "lineno", 0) < line:
            continue
        # (A right operand computed with ``/`` or a float is a tagged float already, whose own
        # reflected method Python calls first: ``0.5 * (h / 2)`` stays tagged.)
        int_valued = not _floaty(n.right, floats - names) and not any(
            isinstance(m, ast.BinOp) and isinstance(m.op, ast.Div) for m in ast.walk(n.right))
        if _floaty(n.left, floats) and int_valued and _mentions(n.right, names, line, positions, ndim):
            warnings.warn(
                f"forward guard: {code.co_filename}:{n.lineno}: a float on the left of a size read from a slab "
                f"(`{ast.unparse(n)}`): Python computes it from the slab's own size, where the guard cannot see it, "
                "so it is this rank's number, not the whole sample's (a silently wrong answer). Write the size "
                "first (`h * 0.01`) or convert it with float(h) (`2 * math.pi / float(h)`), which the guard "
                "evaluates on the global sizes; see the README, 'Inside forward'.",
                ShardingWarning,
                stacklevel=2,
            )
