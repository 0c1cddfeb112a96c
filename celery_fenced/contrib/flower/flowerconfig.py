"""Flower configuration used by ``celery fenced flower`` (Flower's ``--conf`` file).

Flower reads it with tornado's ``parse_config_file``, which runs this file: it installs the
lease-aware task fields and the token rule, and sets the default task list columns.
"""

from celery_fenced.contrib.flower import TASK_COLUMNS, install

install()

tasks_columns = TASK_COLUMNS
