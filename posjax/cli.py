"""What every posjax command does with a mistake: one line, ``error: <what was wrong and what is allowed>``,
exit status 2 (``-v 1`` logs the traceback); Ctrl-C: the line the interrupted command gives (a training run names
its last checkpoint), status 130. Imports nothing of posjax, so every command, with or without JAX, can use it."""

from __future__ import annotations

import os
import sys
import warnings

from absl import app, flags, logging

# What a mistake in the command (or a non-finite loss) raises: reported as one line, without a traceback.
USER_ERRORS = (ValueError, OSError, FloatingPointError, flags.Error, app.UsageError)


def error_message(error: BaseException) -> str:
  """The innermost cause's own words on one line. ml_collections reports an unknown field as a KeyError
  re-raised as an AttributeError whose repr'd text carries the "did you mean"; absl wraps get_config's errors
  in flag-parsing ones."""
  chain = [error]
  while chain[-1].__cause__ is not None or (chain[-1].__context__ is not None
                                            and not chain[-1].__suppress_context__):
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  unknown = [e for e in chain if isinstance(e, (AttributeError, KeyError)) and str(e.args[0]).startswith("'")]
  if unknown:
    texts = [str(e.args[0]) for e in unknown]
    name, _, hint = next((t for t in texts if "\n" in t), texts[-1]).partition("\n")
    key = name.strip("'")
    given = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.") and
             a.split("=")[0].split(".")[-1] == key]
    return f"unknown config field {given[0] if given else name}" + (f"; {' '.join(hint.split())}" if hint else "")
  flag_error = next((e for e in chain if isinstance(e, flags.Error) and str(e).startswith("flag --config.")), None)
  root = flag_error or chain[-1]  # absl's own text names the flag: "flag --config.batch_size=abc: ..."
  text = root.args[0] if len(root.args) == 1 and isinstance(root.args[0], str) else str(root)
  return " ".join(text.split())


def check_directory(path: str, flag: str, allowed: str) -> None:
  """``path``, a directory the command writes (``flag``'s value), can be one: neither it nor a parent up to the
  first that exists is a file; else a ``ValueError`` naming the file and ``allowed``, before anything is written."""
  raw = (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).rstrip(os.sep) or os.sep
  existing = raw  # not normalised: "a_file/../x" is under a file for the system, whatever its text says
  while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  where = "is" if existing == raw else "is under"
  if os.path.islink(existing) and not os.path.exists(existing):
    raise ValueError(f"{flag}={path} {where} a link to nothing ({existing} -> {os.readlink(existing)}); {flag} names "
                     f"a directory: {allowed}")
  if not os.path.isdir(existing):
    raise ValueError(f"{flag}={path} {where} {'a file' if where == 'is' else f'the file {existing}'}; {flag} names "
                     f"a directory: {allowed}")


def run_user_errors(fn, argv) -> None:
  """``fn(argv)``, with a mistake in the command reported as one line (exit status 2) and Ctrl-C as the
  interrupted command's line (130)."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; -v 0 shows it
  try:
    fn(argv)
  except KeyboardInterrupt as interrupted:
    print(str(interrupted) or "interrupted", file=sys.stderr)
    sys.exit(130)
  except USER_ERRORS as error:
    logging.info("the run stopped", exc_info=True)
    # a failed asynchronous save leaves its writes' coroutines unawaited: Python would warn of each at exit, after
    # the line that says what failed
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    print(f"error: {error_message(error)}", file=sys.stderr)
    sys.exit(2)
