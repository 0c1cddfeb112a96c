"""What the package tells the outside while tasks run: Celery events for Flower
(:mod:`.events`), metrics (:mod:`.metrics`), traces (:mod:`.tracing`), and the bounded memo of
names made from stage names (:mod:`.names`)."""
