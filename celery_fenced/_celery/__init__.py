"""What the package reads from Celery itself: the differences between the Celery versions it
supports (:mod:`.compat`, the only module that knows them) and what it keeps per Celery app,
beside the app (:mod:`.apps`). Every other part builds on these; they import no other part."""
