"""The fenced result backend: Celery's Redis backend whose every result write is fenced by the
writer's token (:mod:`.backend`), and the report of each write to whoever hears it
(:mod:`.writes`). It reads only the plain value a request carries; it imports nothing from the
worker side."""
