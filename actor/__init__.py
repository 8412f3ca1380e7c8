"""actor: the vLLM engine that serves generation requests and takes weight updates in flight.

Layout:
- `server.py`  ROUTER socket -> AsyncLLM requests -> streamed TokenDelta replies;
- `stream.py`  one request's sampling parameters, and its outputs as version-labelled deltas;
- `admission.py` what every actor kind serves and refuses (bad request, overloaded);
- `link.py`    the learner link both actor kinds share: Hello, attach, weight updates, version;
- `boundary.py` the error boundary per message: served, refused or failed, never a crash;
- `membership.py` a replica's word to its run: "take me" (`--join`) and "I am leaving";
- `engine_weights.py` the engine's side of the learner link: join, receive, load, with deadlines;
- `weights.py` the vLLM worker extension that receives the learner's broadcast and reloads;
- `receive.py` the buffer an update lands in, kept and filled in a thread while the engine runs;
- `synthetic.py` a timing model of a batching engine on the same protocol (`actor.kind=synthetic`),
  for scale tests without vLLM; not a language model;
- `engine.py`  the vLLM engine: its arguments, how its processes start (fork on CPU), warm-up;
- `main.py`    the process entry point (`millstream actor`): build, warm up, serve, drain.

Importing this package does not import vLLM; `engine.build_engine` does.
"""

__all__: list[str] = []
