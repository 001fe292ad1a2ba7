"""The house rules the design card sets, checked on the source:
modules in tfdist/ and launch/ under MAX_MODULE_LINES lines, functions
under MAX_FUNCTION_LINES, and no circle of imports between modules
(imports inside functions count: they only hide a circle).

python -m tools.house    # prints what breaks a rule; exit 1 if anything
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# {folder: the name it installs under (setup.cfg's package_dir)}: the
# rules hold in tfdist/ and launch/; the zoo is read for its imports.
PACKAGES = {"tfdist": "tfdist", "launch": "tfdist.launch",
            "models": "tfdist.models"}
RULED = ("tfdist/", "launch/")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def modules():
  """{dotted name: path} of every module of the packages."""
  found = {}
  for package, installed in PACKAGES.items():
    for folder, _, names in os.walk(os.path.join(ROOT, package)):
      for name in names:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          inside = os.path.relpath(path, os.path.join(ROOT, package))
          dotted = ".".join([installed, *inside[:-3].split(os.sep)])
          found[dotted.removesuffix(".__init__")] = path
  return found


def _ruled(path):
  return os.path.relpath(path, ROOT).startswith(RULED)


def _tree(path):
  with open(path, encoding="utf-8") as source:
    return ast.parse(source.read(), path)


def long_modules(found):
  """{module: lines} of those over MAX_MODULE_LINES."""
  long = {}
  for name, path in found.items():
    if not _ruled(path):
      continue
    with open(path, encoding="utf-8") as source:
      count = sum(1 for _ in source)
    if count > MAX_MODULE_LINES:
      long[name] = count
  return long


def long_functions(found):
  """{module.function: lines} of those over MAX_FUNCTION_LINES."""
  long = {}
  for name, path in found.items():
    if not _ruled(path):
      continue
    for node in ast.walk(_tree(path)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        count = node.end_lineno - node.lineno + 1
        if count > MAX_FUNCTION_LINES:
          long[f"{name}.{node.name}"] = count
  return long


def _imported(name, path, found):
  """The package modules `name` imports, anywhere in it."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  targets = set()
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Import):
      targets.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for alias in node.names:
        # `from package import module` imports the module, not a circle
        # through the package's __init__.
        full = f"{base}.{alias.name}"
        targets.add(full if full in found else base)
  return {t for t in targets if t in found and t != name}


def import_circles(found):
  """Each circle of imports once, as [a, b, ..., a]."""
  graph = {name: _imported(name, path, found)
           for name, path in found.items()}
  circles, seen = [], set()

  def visit(node, trail):
    for nxt in sorted(graph[node]):
      if nxt in trail:
        circle = trail[trail.index(nxt):] + [nxt]
        key = frozenset(circle)
        if key not in seen:
          seen.add(key)
          circles.append(circle)
      elif len(trail) < 8:
        visit(nxt, trail + [nxt])

  for start in sorted(graph):
    visit(start, [start])
  return circles


def main():
  found = modules()
  broken = [f"{m}: {n} lines (> {MAX_MODULE_LINES})"
            for m, n in sorted(long_modules(found).items())]
  broken += [f"{f}: {n} lines (> {MAX_FUNCTION_LINES})"
             for f, n in sorted(long_functions(found).items())]
  broken += ["import circle: " + " -> ".join(c)
             for c in import_circles(found)]
  print("\n".join(broken) or "house: every rule holds")
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main())
