"""The DeepSpeed backend: the only package that imports DeepSpeed or calls into it (docs/design.md, "The backend
boundary"). This ``__init__`` imports nothing, so a module of the package that imports DeepSpeed only inside its
functions can be used without loading DeepSpeed (the commands that train nothing start without it)."""
