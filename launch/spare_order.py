"""What a warm spare (launch.spare) is handed, and what it said when it
died: the standard library only, since launch.ray_actor ships this module
to Ray's nodes by value with its own code."""

import json


def order_line(*, module, args, env, remote):
  """The one line a spare reads on stdin: run `module` with `args` and
  `env` (added to the host's environment when `remote`)."""
  return (json.dumps({"module": module, "args": list(args),
                      "env": dict(env), "remote": remote}) + "\n").encode()


def read_order(line):
  return json.loads(line)


def last_words(process, limit=300):
  """The last line a spare that exited printed (its error), or ''."""
  try:
    lines = [raw for raw in process.stdout if raw.strip()]
  except (OSError, ValueError):
    return ""
  if not lines:
    return ""
  last = lines[-1]
  if isinstance(last, bytes):
    last = last.decode("utf-8", "replace")
  return last.strip()[:limit]
