"""Names `make lint`'s dead-code check (vulture) must not report: each is used, but by
something vulture cannot see (a framework, a file format, a string reference).

Framework hooks found by decorator or name (routes, validators, Kopf handlers, click
commands, pytest hooks and fixtures) are listed in pyproject.toml's [tool.vulture].
Add a name here only with the reason it is used.
"""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# Overrides of library classes, called by the library.
_.settings_customise_sources  # pydantic-settings (agent/settings.py); keyword arguments
_.dotenv_settings  # ... which it passes by these names
_.file_secret_settings
_.ignore_aliases  # yaml.SafeDumper (api/crd.py)
_._missing_  # enum.Enum (api/node_problems.py)
_.capture_signals  # uvicorn.Server (operator/control.py)
_.install_signal_handlers  # uvicorn.Server (trainer/pod/launcher.py)
_.should_exit  # uvicorn.Server's stop flag
_.daemon_threads  # socketserver.ThreadingMixIn
_.request_queue_size  # socketserver.TCPServer's listen backlog

# Settings written into library objects, read by the library.
_.finalizer  # kopf.OperatorSettings (operator/k8s/handlers.py)
_.progress_storage
_.diffbase_storage
_.disabled
_.server_timeout
_.pre_tokenizer  # tokenizers.Tokenizer (trainer/data/tokenizer.py)
_.decoder
_.caption  # rich.table.Table (cli/plan.py)
_.allow_tf32  # torch.backends (bench/_engine_runs.py)
_.group_count  # torch.distributed's world, reset with its registry (trainer/engine/world.py)
_._attn_implementation  # a transformers config (tests/models/hf_models.py)

# Fields of serialized records: written to JSON / the CRD / a report, read by people or
# by other programs.
_.observed_generation  # TrainingJob status (api/status.py)
_.renew_time  # a Lease's renewTime, compared for equality (operator/k8s/leader.py)
_.first_unit  # a shard in data/.prepare/ (trainer/data/prepare.py)
_.f1_point_adjusted  # agent evaluation scores (agent/evaluate.py), in bench JSON
_.hit_rate_100
_.read_only  # a pod's volume mount (hack/podrunner/model.py), read as mount["read_only"]
# NVML readings of a GPU sample (agent/collectors/base.py), set by the GPU collector and the
# replay scenarios; no rule reads them yet.
_.ecc_corrected_total
_.retired_pages_total
_.remapped_rows_pending

# Named in strings: entry points and user-family references.
_.template_main  # bulkhead.trainer.worker:template_main (trainer/pod/prestart.py's command)
_.NO_HF  # spec.trainer.model.family: hf_models:NO_HF (tests/models)
_.low_fd_limit  # a pytest fixture requested by parameter (tests/checkpoint)
_.bulkhead  # tests/packaging/test_dashboard.py imports modules for their metrics
_.default_pg_timeout  # torch.distributed's module default, read by new_group (world.py)
