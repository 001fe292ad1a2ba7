"""Prints docs/flags.md's flag table from tfdist.options, the one source of
every option: python -m tools.flags_table"""

from tfdist import options


def _default(option):
  if option.kind == "ints":
    return ",".join(map(str, option.default)) if option.default else "none"
  if option.kind == "bool":
    return "true" if option.default else "false"
  if option.default == "":
    return "(empty)" if option.name != "model_dir" else "(required)"
  return f"`{option.default}`" if option.kind in ("str", "enum") else str(
      option.default)


def table():
  lines = []
  for section in options.SECTIONS:
    lines += [f"**{section}**", "", "| flag | default | meaning |",
              "|---|---|---|"]
    for option in options.OPTIONS:
      if option.section != section:
        continue
      meaning = option.help.replace("|", "\\|")
      if option.kind == "enum":
        meaning += " One of: " + ", ".join(f"`{c}`" for c in option.choices)
        meaning += "."
      lines.append(f"| `--{option.name}` | {_default(option)} | {meaning} |")
    lines.append("")
  return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
  print(table(), end="")
