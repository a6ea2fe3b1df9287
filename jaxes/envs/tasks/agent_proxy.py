"""Agent code that the final tests import runs in a process of its own, never in the tests'.

A test file that does ``import solution`` (or ``spec_from_file_location(..., "/home/user/x.py")``)
would run the agent's module inside the tests' process, where it could write the counts, patch
pytest, or exit early. Here the tests' process (``install``) never executes a file the agent's
uid could have written: such a module is loaded in the agent-code server (``serve``: a
separate, non-privileged process started on first use, holding nothing but its two pipes), and
the tests get a stand-in whose attributes, calls and operators are requests to that server,
answered with plain data (None, bool, int, float, complex, str, bytes, bytearray, and lists,
tuples, dicts, sets of them, ``pathlib`` paths) or with references to objects that stay there.
Decoding builds only those builtin types, so no reply can run code in the tests' process.

What the stand-ins cannot do (docs/envs.md, "Agent code the tests import"): arguments are
copies (in-place changes to a list, dict, set or bytearray argument are copied back, nothing
deeper); functions or other objects of the tests' own cannot be passed in; output the agent's
code writes to file descriptor 1 or 2 directly (or its child processes) is not seen (``print``
is); an agent object compares equal only to agent objects (its ``__eq__`` never answers for a
plain value: an object claiming to equal whatever the test expects earns nothing); exception
classes the agent defines arrive as subclasses of their nearest builtin base; a module name the
system's Python already has always means the system's module.

Guards behind the stand-ins (an audit hook, ``sys.addaudithook``): code compiled from a file the
agent could write never executes in the tests' process, whatever loads it (``runpy``,
``exec(compile(...))``, another import hook); ``ctypes`` never loads a library the agent could
write; unpickling builds only a few plain classes.

This file is stdlib-only source: the verifier sends its text into the sandbox, where the tests'
process runs it with ``exec`` and the server with ``python3 -c`` (``__main__`` below).
"""
import builtins
import json
import operator
import os
import sys
import types

MAX_MESSAGE = 64 << 20        # a reply larger than this is refused (the test fails)
_MAX_DEPTH = 200
_PLAIN = (type(None), bool, int, float, str)


class AgentCodeError(RuntimeError):
  """The agent-code server died, or answered something that is not a reply."""


# ---- the wire: length-prefixed JSON of tagged plain data (both sides) ----------------------

def encode(value, as_ref, depth=0):
  """JSON-able form of ``value``; ``as_ref`` encodes anything that is not plain data."""
  kind = type(value)
  if kind in _PLAIN:
    return value
  if depth > _MAX_DEPTH:
    raise TypeError("data nested too deep to pass to the agent's code")
  again = lambda items: [encode(v, as_ref, depth + 1) for v in items]
  if kind is list:
    return again(value)
  if kind is tuple:
    return {"t": again(value)}
  if kind is dict:
    return {"d": [[encode(k, as_ref, depth + 1), encode(v, as_ref, depth + 1)]
                  for k, v in value.items()]}
  if kind is set:
    return {"s": again(value)}
  if kind is frozenset:
    return {"f": again(value)}
  if kind is bytes:
    return {"b": value.hex()}
  if kind is bytearray:
    return {"y": value.hex()}
  if kind is complex:
    return {"c": [value.real, value.imag]}
  if isinstance(value, os.PathLike) and type(value).__module__ == "pathlib":
    return {"p": os.fspath(value)}
  return as_ref(value)


def decode(data, from_ref, depth=0):
  """The value ``encode`` wrote, built from builtin types only (``from_ref`` makes references)."""
  kind = type(data)
  if kind in _PLAIN:
    return data
  if depth > _MAX_DEPTH:
    raise AgentCodeError("a reply nested too deep")
  again = lambda items: [decode(v, from_ref, depth + 1) for v in _list(items)]
  if kind is list:
    return again(data)
  if kind is not dict or len(data) != 1:
    raise AgentCodeError("a malformed reply")
  (tag, body), = data.items()
  if tag == "t":
    return tuple(again(body))
  if tag == "d":
    return {decode(k, from_ref, depth + 1): decode(v, from_ref, depth + 1)
            for k, v in (_pair(p) for p in _list(body))}
  if tag in ("s", "f"):
    return (set if tag == "s" else frozenset)(again(body))
  if tag in ("b", "y"):
    return (bytes if tag == "b" else bytearray).fromhex(_str(body))
  if tag == "c":
    real, imag = _list(body)
    return complex(float(real), float(imag))
  if tag == "p":
    import pathlib
    return pathlib.Path(_str(body))
  if tag == "r":
    return from_ref(body)
  raise AgentCodeError("a malformed reply")


def _list(x):
  if type(x) is not list:
    raise AgentCodeError("a malformed reply")
  return x


def _str(x):
  if type(x) is not str:
    raise AgentCodeError("a malformed reply")
  return x


def _pair(x):
  if type(x) is not list or len(x) != 2:
    raise AgentCodeError("a malformed reply")
  return x


def _send(fd, message):
  data = json.dumps(message, separators=(",", ":")).encode()
  data = len(data).to_bytes(4, "big") + data
  while data:
    data = data[os.write(fd, data):]


def _receive(fd):
  head = _read_exactly(fd, 4)
  if head is None:
    return None
  size = int.from_bytes(head, "big")
  if size > MAX_MESSAGE:
    raise AgentCodeError(f"a reply of {size} bytes (at most {MAX_MESSAGE})")
  body = _read_exactly(fd, size)
  if body is None:
    return None
  try:
    return json.loads(body)
  except (ValueError, RecursionError) as e:
    raise AgentCodeError(f"an unreadable reply: {e}") from None


def _read_exactly(fd, n):
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


# ---- the tests' side ---------------------------------------------------------------------------

def agent_file(path, roots, trusted=(), writable=None):
  """Whether ``path`` may hold code the agent wrote: anything but a file under the system
  Python's own directories (``roots``) with nothing on its way there writable by this uid.
  (Ownership is no test here: in the local sandbox's user namespace root's files show as the
  overflow uid, which may be the agent's.) Names that are no path ("<string>") are not files.
  ``writable``: a dict caching the answer per directory (this uid cannot make a directory it
  may not write writable, unless it owns it, so the answer holds for the run)."""
  if not isinstance(path, str) or not path.startswith("/"):
    return False
  if path in trusted:
    return False
  real = os.path.realpath(path)
  if not any(real == root or real.startswith(root + "/") for root in roots):
    return True
  if os.access(real, os.W_OK):
    return True
  real = os.path.dirname(real)
  while real != "/":
    answer = writable.get(real) if writable is not None else None
    if answer is None:
      answer = os.access(real, os.W_OK)
      if writable is not None:
        writable[real] = answer
    if answer:
      return True
    real = os.path.dirname(real)
  return False


class Client:
  """The tests' end of the agent-code server (started on first use)."""

  def __init__(self, source, python):
    self.source, self.python = source, python
    self.pid = self.send_fd = self.reply_fd = None
    self.dead = None
    self.refs = {}           # reference id -> stand-in (so `is` holds for the same object)
    self.sent_env = None

  def _start(self):
    import fcntl
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    # High, close-on-exec copies, so the dup2s below never collide with each other.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in (req_r, rep_w)]
    for fd in (req_r, rep_w):
      os.close(fd)
    # -S: no site start-up (the time of a light run); it imports with the tests' sys.path.
    argv = [self.python, "-I", "-B", "-S", "-c", self.source, "3", "4"]
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0),
               (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2),
               (os.POSIX_SPAWN_DUP2, high[0], 3), (os.POSIX_SPAWN_DUP2, high[1], 4)]
    try:
      self.pid = os.posix_spawn(self.python, argv, dict(os.environ), file_actions=actions,
                                setsid=True)
    finally:
      for fd in high:
        os.close(fd)
    self.send_fd, self.reply_fd = req_w, rep_r

  def request(self, op, **fields):
    if self.dead:
      raise AgentCodeError(self.dead)
    if self.pid is None:
      self._start()
    env = dict(os.environ)
    fields.update(op=op, cwd=os.getcwd(), argv=list(sys.argv), path=list(sys.path))
    if env != self.sent_env:
      fields["env"], self.sent_env = env, env
    try:
      _send(self.send_fd, fields)
      reply = _receive(self.reply_fd)
    except BrokenPipeError:   # the server is gone: as an end of file on the reply pipe
      reply = None
    except OSError as e:
      reply = None
      self.dead = f"the agent's code could not be reached: {e}"
    except AgentCodeError as e:   # out of step with the server from here on
      self.dead = str(e)
      raise
    if reply is None:
      self.dead = self.dead or "the agent's code exited or was killed"
      raise AgentCodeError(self.dead)
    if type(reply) is not dict:
      raise AgentCodeError("a malformed reply")
    for stream, key in ((sys.stdout, "out"), (sys.stderr, "err")):
      if reply.get(key):
        stream.write(_str(reply[key]))
    if "raise" in reply:
      raise self._exception(reply["raise"])
    return reply

  def value(self, op, **fields):
    return self.decode(self.request(op, **fields).get("value"))

  def decode(self, data):
    try:
      return decode(data, self._stand_in)
    except AgentCodeError:
      raise
    except Exception as e:   # hex that is not, a complex of three parts…: the reply's fault
      raise AgentCodeError(f"a malformed reply: {e!r}") from None

  def encode(self, value):
    def as_ref(v):
      if isinstance(v, Remote) and object.__getattribute__(v, "_client") is self:
        return {"r": {"id": object.__getattribute__(v, "_id")}}
      raise TypeError(f"{type(v).__name__} objects cannot be passed to the agent's code "
                      "(only plain data and its own objects)")
    return encode(value, as_ref)

  def _stand_in(self, body):
    if type(body) is not dict or type(body.get("id")) is not int:
      raise AgentCodeError("a malformed reference")
    ref = body["id"]
    if ref not in self.refs:
      if body.get("kind") == "exception":
        base = getattr(builtins, _str(body.get("base", "Exception")), None)
        if not (isinstance(base, type) and issubclass(base, BaseException)):
          base = Exception
        name = _str(body.get("name", "AgentError")).rpartition(".")[2] or "AgentError"
        self.refs[ref] = type(name, (base,), {"__module__": "agent code", "_jaxes_ref": ref})
      else:
        cls = RemoteClass if body.get("kind") == "class" else Remote
        self.refs[ref] = cls(self, ref)
    return self.refs[ref]

  def _exception(self, body):
    if type(body) is not dict:
      return AgentCodeError("a malformed reply")
    cls = None
    if "class" in body:
      cls = self._stand_in(body["class"])
    elif isinstance(getattr(builtins, str(body.get("type")), None), type):
      cls = getattr(builtins, body["type"])
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
      cls = AgentCodeError
    try:
      args = self.decode(body.get("args", []))
      error = cls(*args)
    except Exception:
      error = cls(str(body.get("text", "")))
    if hasattr(error, "add_note") and body.get("text"):
      error.add_note("in the agent's code (its own process):\n" + _str(body["text"]))
    return error

  def stop(self):
    if self.pid is not None:
      for fd in (self.send_fd, self.reply_fd):
        os.close(fd)
      try:
        os.killpg(self.pid, 9)
      except OSError:
        pass
      os.waitpid(self.pid, 0)
      self.pid = None
      self.dead = "stopped"


def _ref_of(remote):
  return object.__getattribute__(remote, "_client"), object.__getattribute__(remote, "_id")


class Remote:
  """An object of the agent's, in its own process: every use is a request there."""
  __slots__ = ("_client", "_id", "__weakref__")

  def __init__(self, client, ref):
    object.__setattr__(self, "_client", client)
    object.__setattr__(self, "_id", ref)

  def _op(self, name, *args):
    client, ref = _ref_of(self)
    return client.value("op", name=name, args=client.encode([self, *args]))

  def __getattr__(self, name):
    client, ref = _ref_of(self)
    return client.value("getattr", ref=ref, name=name)

  def __setattr__(self, name, value):
    client, ref = _ref_of(self)
    client.request("setattr", ref=ref, name=name, value=client.encode(value))

  def __delattr__(self, name):
    client, ref = _ref_of(self)
    client.request("delattr", ref=ref, name=name)

  def __call__(self, *args, **kwargs):
    client, ref = _ref_of(self)
    reply = client.request("call", ref=ref, args=client.encode(list(args)),
                           kwargs=client.encode(kwargs))
    for i, new in (reply.get("copied_back") or {}).items():
      _copy_back(args[int(i)], client.decode(new))
    return client.decode(reply.get("value"))

  def __eq__(self, other):   # only between the agent's own objects (module docstring)
    return self._op("eq", other) if isinstance(other, Remote) else NotImplemented

  def __ne__(self, other):
    return self._op("ne", other) if isinstance(other, Remote) else NotImplemented

  def __exit__(self, *exc):
    # It hears of no exception and never swallows one: an assertion failing inside
    # `with agent_object:` stays failed.
    self._op("exit", None, None, None)
    return False


def _forward(name):
  def method(self, *args):
    return self._op(name, *args)
  method.__name__ = name
  return method


_UNARY = ("len", "neg", "pos", "abs", "invert", "int", "float", "index", "round", "hash", "str",
          "repr", "dir", "iter", "next", "enter")
_BINARY = ("lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
           "matmul", "and", "or", "xor", "lshift", "rshift")
for _name in _UNARY + ("getitem", "setitem", "delitem", "contains", "format"):
  setattr(Remote, f"__{_name}__", _forward(_name))
Remote.__bool__ = _forward("truth")
for _name in _BINARY:
  setattr(Remote, f"__{_name}__", _forward(_name))
  if _name not in ("lt", "le", "gt", "ge"):
    setattr(Remote, f"__r{_name}__", _forward("r" + _name))


class RemoteClass(Remote):
  """A class of the agent's: ``isinstance`` asks its process."""
  __slots__ = ()

  def __instancecheck__(self, obj):
    return isinstance(obj, Remote) and self._op("isinstance_of", obj)

  def __subclasscheck__(self, cls):
    return isinstance(cls, Remote) and self._op("subclass_of", cls)


def _copy_back(arg, new):
  if type(arg) is not type(new):
    return
  if type(arg) in (list, bytearray):
    arg[:] = new
  else:   # dict, set
    arg.clear()
    arg.update(new)


class RemoteModule(types.ModuleType):
  """A module of the agent's: names it does not hold locally (its ``__spec__``, ``__file__``…)
  are asked for in the agent's process."""

  def __getattr__(self, name):
    ref = self.__dict__.get("_jaxes_ref")
    if ref is None or (name.startswith("__") and name.endswith("__") and name != "__all__"):
      raise AttributeError(name)
    try:
      return ref.__getattr__(name)
    except AttributeError:
      if name != "__all__":
        raise
      # `from agent_module import *` of a module without __all__: its public names, as Python
      # would take them from the module's own __dict__.
      return [n for n in dir(ref) if not n.startswith("_")]

  def __setattr__(self, name, value):
    if name.startswith("__") or "_jaxes_ref" not in self.__dict__:
      super().__setattr__(name, value)
    else:
      setattr(self.__dict__["_jaxes_ref"], name, value)

  def __dir__(self):
    return sorted(set(self.__dict__) | set(dir(self.__dict__["_jaxes_ref"])))


def install(source, python, trusted=()):
  """Makes this process route every module the agent could have written to the agent-code
  server and adds the audit-hook guards. ``trusted``: paths of ours that live where the agent's
  uid could write (the tests' own file). Returns (the import finder, the client)."""
  import importlib.machinery
  import importlib.util
  client = Client(source, python)
  trusted = frozenset(trusted)
  initial_path = [p for p in sys.path if p.startswith("/")]
  roots = tuple(os.path.realpath(p) for p in initial_path)
  writable = {}
  agent = lambda path: agent_file(path, roots, trusted, writable)

  def from_agent(spec):
    origin = spec.origin if spec.has_location else None
    if origin is None:
      return False
    if origin.endswith(".py"):
      try:
        cached = importlib.util.cache_from_source(origin)
      except (NotImplementedError, ValueError):
        cached = None
      if cached and os.path.exists(cached) and agent(cached):
        return True
    return agent(origin)

  def load_remote(module, path):
    spec = getattr(module, "__spec__", None)
    search = getattr(spec, "submodule_search_locations", None)
    ref = client.value("load", name=module.__name__, origin=path,
                       search=None if search is None else [str(s) for s in search])
    module.__class__ = RemoteModule
    module.__dict__["_jaxes_ref"] = ref

  class AgentLoader:
    def __init__(self, path):
      self.path = path

    def create_module(self, spec):
      return None

    def exec_module(self, module):
      load_remote(module, self.path)

  class AgentFinder:
    """First on ``sys.meta_path``: a module found in a place the agent could write loads in
    the agent's process; a top-level name the system's Python has is always the system's."""

    @staticmethod
    def find_spec(name, path=None, target=None):
      spec = importlib.machinery.PathFinder.find_spec(name, path)
      if spec is None or not from_agent(spec):
        return None
      if path is None:
        system = importlib.machinery.PathFinder.find_spec(name, initial_path)
        if system is not None and not from_agent(system):
          return system
      remote = importlib.util.spec_from_loader(name, AgentLoader(spec.origin), origin=spec.origin,
                                               is_package=spec.submodule_search_locations is not None)
      if spec.submodule_search_locations is not None:
        remote.submodule_search_locations = list(spec.submodule_search_locations)
      remote.has_location = True
      return remote

  # spec_from_file_location(..., agent_path) gives these loaders directly, bypassing finders.
  for cls in (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
              importlib.machinery.ExtensionFileLoader):
    def create_module(self, spec, _original=cls.create_module):
      return None if agent(self.path) else _original(self, spec)

    def exec_module(self, module, _original=cls.exec_module):
      if agent(self.path):
        return load_remote(module, self.path)
      return _original(self, module)
    cls.create_module, cls.exec_module = create_module, exec_module

  safe_classes = {("builtins", n) for n in ("set", "frozenset", "bytearray", "complex", "slice",
                                             "range", "list", "dict", "tuple", "int", "float",
                                             "str", "bytes", "bool")} | {
      ("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")} | {
      ("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")} | {
      ("decimal", "Decimal"), ("fractions", "Fraction"), ("copyreg", "_reconstructor")}

  def guard(event, args):
    if event == "exec":
      filename = getattr(args[0], "co_filename", None)
      if agent(filename):
        raise PermissionError(f"the agent's code ({filename}) does not run in the tests' process")
    elif event == "ctypes.dlopen":
      if isinstance(args[0], str) and "/" in args[0] and agent(args[0]):
        raise PermissionError(f"the agent's library {args[0]} is not loaded in the tests' process")
    elif event == "pickle.find_class":
      if (args[0], args[1]) not in safe_classes:
        raise PermissionError(f"unpickling {args[0]}.{args[1]} is refused in the tests' process")
  sys.addaudithook(guard)
  finder = AgentFinder()
  sys.meta_path.insert(0, finder)
  return finder, client


# ---- the agent's side --------------------------------------------------------------------------

def serve(request_fd, reply_fd):
  """The agent-code server's loop: one request, one reply, until its input closes."""
  import contextlib
  import importlib
  import importlib.util
  import io
  import traceback
  objects, ids = {}, {}

  def as_ref(value):
    for base in (bool, int, float, str, bytes, complex):
      if isinstance(value, base):
        return encode(base(value), as_ref)
    for base in (tuple, list, dict, set, frozenset):
      if isinstance(value, base):
        return encode(base(value), as_ref)
    key = id(value)
    if key not in ids:
      ids[key] = len(objects)
      objects[ids[key]] = value
    body = {"id": ids[key], "kind": "object"}
    if isinstance(value, type):
      body["kind"] = "class"
      body["name"] = getattr(value, "__qualname__", "?")
      if issubclass(value, BaseException):
        body["kind"] = "exception"
        body["base"] = next(c.__name__ for c in value.__mro__ if c.__module__ == "builtins")
    return {"r": body}

  def from_ref(body):
    if type(body) is not dict or body.get("id") not in objects:
      raise ValueError("an unknown reference")
    return objects[body["id"]]

  value_of = lambda data: decode(data, from_ref)
  out_of = lambda value: encode(value, as_ref)

  def load(req):
    name, origin, search = req["name"], req["origin"], req.get("search")
    known = sys.modules.get(name)   # imported already by the agent's own modules: that one
    if known is not None and os.path.realpath(getattr(known, "__file__", "") or "") == (
        os.path.realpath(origin)):
      return known
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
      importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, origin, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
      spec.loader.exec_module(module)
    except BaseException:
      sys.modules.pop(name, None)
      raise
    return module

  ops = {"truth": bool, "str": str, "repr": repr, "hash": hash, "dir": dir, "len": len,
         "iter": iter, "next": next, "int": int, "float": float, "round": round,
         "format": format, "enter": lambda o: o.__enter__(), "exit": lambda o, *a: o.__exit__(*a),
         "isinstance_of": lambda cls, o: isinstance(o, cls),
         "subclass_of": lambda cls, c: issubclass(c, cls), "contains": lambda o, x: x in o}
  for name in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv",
               "mod", "pow", "matmul", "and_", "or_", "xor", "lshift", "rshift", "neg", "pos",
               "abs", "invert", "index", "getitem", "setitem", "delitem"):
    ops[name.rstrip("_")] = getattr(operator, name)

  def handle(req):
    op = req["op"]
    if op == "load":
      return load(req), None
    if op == "getattr":
      return getattr(objects[req["ref"]], req["name"]), None
    if op == "setattr":
      return setattr(objects[req["ref"]], req["name"], value_of(req["value"])), None
    if op == "delattr":
      return delattr(objects[req["ref"]], req["name"]), None
    if op == "call":
      args, kwargs = value_of(req["args"]), value_of(req["kwargs"])
      result = objects[req["ref"]](*args, **kwargs)
      back = {str(i): out_of(a) for i, a in enumerate(args)
              if type(a) in (list, dict, set, bytearray)}
      return result, back
    if op == "op":
      args, name = value_of(req["args"]), req["name"]
      if name not in ops:                  # a reflected operator: other <op> self
        name, args = name[1:], args[::-1]
      return ops[name](*args), None
    raise ValueError(f"unknown request {op!r}")

  own_path = list(sys.path)
  while True:
    req = _receive(request_fd)
    if req is None:
      return
    if req.get("env") is not None:
      os.environ.clear()
      os.environ.update(req["env"])
    sys.argv[:] = req["argv"]
    sys.path[:] = req["path"] + [p for p in own_path if p not in req["path"]]
    out, err = io.StringIO(), io.StringIO()
    reply = {}
    try:
      os.chdir(req["cwd"])
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result, back = handle(req)
      reply["value"] = out_of(result)
      if back:
        reply["copied_back"] = back
    except BaseException as e:   # noqa: B036 (SystemExit, KeyboardInterrupt included: the test decides)
      body = {"type": next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"),
              "text": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}
      if type(e).__module__ != "builtins":
        body["class"] = as_ref(type(e))["r"]
      try:
        body["args"] = out_of(list(e.args))
      except Exception:
        body["args"] = [str(e)]
      reply = {"raise": body}
    reply["out"], reply["err"] = out.getvalue(), err.getvalue()
    _send(reply_fd, reply)


if __name__ == "__main__" and len(sys.argv) == 3:   # python3 -c SOURCE 3 4: the server
  _fds = int(sys.argv[1]), int(sys.argv[2])
  sys.argv = [""]
  serve(*_fds)
