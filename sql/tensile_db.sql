-- tensile_db install script. The build copies it to tensile_db--<version>.sql (extension/Makefile).
\echo Use "CREATE EXTENSION tensile_db CASCADE" to load this file. \quit

-- Security. Every statement here and every statement the extension's functions run qualifies its
-- functions, operators and types (pg_catalog., tensile., OPERATOR(pg_catalog.=)), or runs with a
-- pinned search_path, so objects another role creates in a schema on a caller's search_path are
-- never called; only a user's `source` query is resolved with the caller's path. CREATE EXTENSION
-- uses the schema tensile if it exists already: refuse one that another role owns, since its
-- owner could have planted objects in it.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r
               WHERE n.nspname OPERATOR(pg_catalog.=) 'tensile' AND r.rolname OPERATOR(pg_catalog.=) current_user
                 AND n.nspowner OPERATOR(pg_catalog.<>) r.oid) THEN
        RAISE EXCEPTION 'schema tensile exists and is owned by another role'
            USING HINT = 'drop or rename that schema, then CREATE EXTENSION tensile_db again';
    END IF;
END
$$;

-- The model registry -----------------------------------------------------------------------------

CREATE TABLE tensile.models (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- changes when a model is replaced
    name          text NOT NULL UNIQUE CHECK (name <> '' AND length(name) <= 63),
    owner         name NOT NULL DEFAULT current_user,
    task          text NOT NULL CHECK (task IN ('classification', 'regression')),
    architecture  jsonb NOT NULL,
    options       jsonb NOT NULL,
    feature_names text[] NOT NULL,
    label_name    text NOT NULL,
    label_classes double precision[],          -- classification: the class of each output, in order
    metrics       jsonb NOT NULL,
    weights       bytea NOT NULL,               -- numpy .npz of float32 arrays, no pickle
    created_at    timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE tensile.models IS 'Trained models: architecture, options, features, classes, metrics and weights';
SELECT pg_catalog.pg_extension_config_dump('tensile.models', '');
SELECT pg_catalog.pg_extension_config_dump('tensile.models_id_seq', '');

-- A model is visible to its owner and to members of the owning role (train as a group role, or
-- GRANT your role, to share); only its owner may create, replace or drop it. Models reveal facts
-- about their training data (label classes, column means), so nothing is public by default.
ALTER TABLE tensile.models ENABLE ROW LEVEL SECURITY;
CREATE POLICY models_visible ON tensile.models FOR SELECT USING (
    owner OPERATOR(pg_catalog.=) current_user
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) owner AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')));
CREATE POLICY models_owned ON tensile.models FOR ALL
    USING (owner OPERATOR(pg_catalog.=) current_user) WITH CHECK (owner OPERATOR(pg_catalog.=) current_user);
GRANT USAGE ON SCHEMA tensile TO PUBLIC;
-- Rows are written only by the extension, through tensile._write_model() (below), which checks
-- what it writes; roles read the rows row-level security shows them.
REVOKE ALL ON tensile.models FROM PUBLIC;
GRANT SELECT ON tensile.models TO PUBLIC;

-- Model names are unique across roles, so training checks a name against every model, visible
-- or not; this reveals a name's owner and nothing else.
CREATE FUNCTION tensile._model_owner(model_name text) RETURNS name
LANGUAGE sql STABLE STRICT PARALLEL SAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT owner FROM tensile.models WHERE name OPERATOR(pg_catalog.=) model_name
$$;
COMMENT ON FUNCTION tensile._model_owner(text) IS 'The owner of a model name, visible or not (internal)';

-- Every PL/Python function here is PARALLEL UNSAFE: plpy.execute runs each query in a
-- subtransaction, which PostgreSQL forbids during a parallel operation.

-- Server-level settings ----------------------------------------------------------------------------
-- The tensile.* settings choose the program the server spawns as its OS user and the device
-- budget every job shares, so they are read from the configuration files (postgresql.conf and
-- what it includes) only: a session's SET or connection options cannot change them. The scheduler
-- policy (tensile.policy) is one of them: one coordinator schedules the tensors of every job.

CREATE FUNCTION tensile._server_setting(setting_name text) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT setting FROM pg_catalog.pg_file_settings
    WHERE name OPERATOR(pg_catalog.=) setting_name AND setting_name OPERATOR(pg_catalog.~~) 'tensile.%'
      AND applied AND error IS NULL
    ORDER BY seqno DESC LIMIT 1
$$;
COMMENT ON FUNCTION tensile._server_setting(text) IS
'The value of a tensile.* setting in the configuration files, or NULL (internal)';

-- Loading the Python package once per session -----------------------------------------------------

CREATE FUNCTION tensile._bootstrap() RETURNS void
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
import site, sys
extra = plpy.execute("SELECT tensile._server_setting('tensile.python_path') AS p")[0]["p"]
for directory in (extra or "").split(":"):
    if directory and directory not in sys.path:
        site.addsitedir(directory)
try:
    import tensile_db.pg.entry as entry
except ImportError as exc:
    plpy.error(f"cannot import the tensile_db Python package: {exc}",
               hint="install it into the Python 3.11 that PL/Python embeds, or set tensile.python_path "
                    "to the site-packages directory that holds it")
GD["tensile"] = entry
$$;
COMMENT ON FUNCTION tensile._bootstrap() IS 'Imports the tensile_db package into this session (internal)';

-- Writing the model registry ---------------------------------------------------------------------
-- The one way rows reach tensile.models: it applies the write that the extension's own code staged
-- in this session (tensile_db.pg.registry) after validating the model, and nothing else; called
-- directly it finds nothing staged and raises.

CREATE FUNCTION tensile._write_model() RETURNS bigint
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].write_model(plpy, GD)
$$;
COMMENT ON FUNCTION tensile._write_model() IS
'Applies the registry write staged by train_model or drop_model in this session (internal)';

-- Training ---------------------------------------------------------------------------------------

CREATE PROCEDURE tensile.train_model(
    model_name   text,
    source       text,
    label        text,
    features     text[] DEFAULT NULL,
    architecture jsonb DEFAULT '{"layers": [{"dense": 64, "activation": "relu"}]}',
    options      jsonb DEFAULT '{}',
    INOUT task   text DEFAULT NULL,
    INOUT metrics jsonb DEFAULT NULL)
LANGUAGE plpython3u AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].train_model(plpy, GD, model_name, source, label, features, architecture, options)
$$;
COMMENT ON PROCEDURE tensile.train_model(text, text, text, text[], jsonb, jsonb, text, jsonb) IS
'Trains a model on the rows of source (a query or table name) to predict label from features '
'(default: every other numeric column), on the shared coordinator, and stores it in tensile.models';

-- Inference --------------------------------------------------------------------------------------

CREATE FUNCTION tensile.predict(model_name text, features real[]) RETURNS double precision
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict(text, real[]) IS
'Predicts one row on the CPU of this backend: the class label (classification) or the value (regression)';

CREATE FUNCTION tensile.predict_proba(model_name text, features real[]) RETURNS real[]
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_proba(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict_proba(text, real[]) IS
'Class probabilities of one row, in the order of tensile.models.label_classes';

CREATE FUNCTION tensile.predict_batch(model_name text, source text, key text DEFAULT NULL,
                                      options jsonb DEFAULT '{}')
RETURNS TABLE (id bigint, prediction double precision, probabilities real[])
-- STABLE: every SPI query of one call sees the calling statement's snapshot, so the model row, its
-- weights and the source are read as of one moment.
LANGUAGE plpython3u STABLE CALLED ON NULL INPUT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_batch(plpy, GD, model_name, source, key, options)
$$;
COMMENT ON FUNCTION tensile.predict_batch(text, text, text, jsonb) IS
'Predicts every row of source (a query or table name, read as the calling role) on the coordinator''s '
'device, streaming batches through the layers with a prefetch window: id (the key column, or the row''s '
'ordinal), the class label or value, and the class probabilities (NULL for regression). Options: window '
'(integer >= 1 or "all"; default tensile.prefetch_window), batch_size, cache, skip_nulls';

CREATE PROCEDURE tensile.predict_into(model_name text, source text, target text, key text DEFAULT NULL,
                                      options jsonb DEFAULT '{}', INOUT rows bigint DEFAULT NULL)
LANGUAGE plpython3u AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_into(plpy, GD, model_name, source, target, key, options)
$$;
COMMENT ON PROCEDURE tensile.predict_into(text, text, text, text, jsonb, bigint) IS
'Writes tensile.predict_batch''s rows (id bigint, prediction double precision, probabilities real[]) into '
'target, creating the table if it does not exist, else appending, in the caller''s transaction; returns '
'the number of rows written';

CREATE FUNCTION tensile.drop_model(model_name text) RETURNS boolean
LANGUAGE plpython3u VOLATILE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].drop_model(plpy, GD, model_name)
$$;
COMMENT ON FUNCTION tensile.drop_model(text) IS 'Deletes a model the current role owns';

-- The coordinator --------------------------------------------------------------------------------

CREATE FUNCTION tensile.job_status(
    OUT job_id integer, OUT backend_pid integer, OUT role text, OUT model_name text, OUT state text,
    OUT epoch integer, OUT epochs integer, OUT loss double precision,
    OUT device_bytes bigint, OUT peak_device_bytes bigint, OUT vanilla_peak_bytes bigint,
    OUT swapped_out_bytes bigint, OUT swapped_in_bytes bigint, OUT host_bytes bigint,
    OUT policy text, OUT schedule text, OUT planned_swap_ins bigint, OUT passive_swap_ins bigint,
    OUT recomputes bigint,
    OUT created_at timestamptz, OUT started_at timestamptz)
RETURNS SETOF record
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].jobs(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.job_status() IS
'Live jobs of every backend, from the coordinator (role, model_name and loss only for jobs of roles the '
'caller is a member of, or for superusers and pg_monitor): progress, device and swapped bytes, the scheduler '
'policy, whether the job runs on a plan (schedule: cold start, planned or reactive), and its counts of '
'planned swap-ins, passive (unplanned) swap-ins and recomputes';
CREATE VIEW tensile.jobs AS SELECT * FROM tensile.job_status();
GRANT SELECT ON tensile.jobs TO PUBLIC;
COMMENT ON VIEW tensile.jobs IS
'Live training jobs of every backend: state, epoch, loss, device and swapped bytes, policy, schedule, '
'planned and passive swap-ins, recomputes';

CREATE FUNCTION tensile.memory_status(
    OUT device text, OUT budget_bytes bigint, OUT in_use_bytes bigint, OUT peak_bytes bigint,
    OUT host_bytes bigint, OUT free_blocks integer, OUT largest_free_bytes bigint,
    OUT fragmentation double precision, OUT running_jobs integer, OUT queued_jobs integer,
    OUT policy text, OUT h2d_bytes_per_s double precision, OUT d2h_bytes_per_s double precision,
    OUT plans_made integer, OUT predicted_peak_bytes bigint, OUT predicted_extra_s double precision,
    OUT pool text, OUT planned_region_bytes bigint, OUT pool_plans_installed integer,
    OUT planned_allocations bigint, OUT pool_mismatches bigint, OUT planned_arena_bytes bigint,
    OUT max_live_bytes bigint, OUT general_pool_bytes bigint,
    OUT inference_calls integer, OUT inference_bytes bigint, OUT weight_cache_bytes bigint,
    OUT weight_loads bigint, OUT weight_cache_hits bigint, OUT weight_cache_evictions bigint,
    OUT per_job jsonb, OUT started_at timestamptz,
    OUT compactions bigint, OUT compacted_bytes bigint, OUT served_models integer, OUT served_host_bytes bigint)
RETURNS SETOF record
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].memory(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.memory_status() IS
'The device arena: budget, bytes in use, high-water mark since the coordinator started, per-job bytes; '
'and the scheduler: policy, host-to-device and device-to-host bandwidth measured at start (bytes per '
'second), plans made, and the latest plan''s predicted peak bytes and extra seconds per period; '
'and the planned pool: its state (idle, recording, planning, serving, or general only), the bytes its '
'region holds, plans installed, allocations served by lookup, mismatches that sent requests back to the '
'general pool, and for the last recorded period the planned arena, the lower bound (max live bytes) and '
'the highest byte the best-fit general pool touches on the same trace; per_job carries the same three '
'for each job alone; and batch inference: predict calls running or waiting for device memory, the '
'device bytes they hold, the bytes of model layers kept in the weight cache (counted in in_use_bytes '
'too), layer loads host to device, '
'layer uses served from the cache, and cached layers evicted for room; per_job names models only as '
'tensile.job_status does; and the arena compactions made and the bytes they moved, the model versions '
'served from host memory and their bytes';
CREATE VIEW tensile.memory AS SELECT * FROM tensile.memory_status();
GRANT SELECT ON tensile.memory TO PUBLIC;
COMMENT ON VIEW tensile.memory IS
'The device: budget, in use, peak, host bytes, fragmentation, per job; the scheduler: policy, '
'bandwidths, plans made, predicted peak and extra time; the planned pool: state, region, lookups, '
'mismatches, planned arena against its lower bound and the general pool; batch inference: running '
'calls, their bytes, the weight cache''s bytes, loads, hits and evictions; compactions and the models '
'served from host memory';

CREATE FUNCTION tensile.start_coordinator() RETURNS integer
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].start_coordinator(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.start_coordinator() IS
'Starts the coordinator if none runs (training starts it on demand too); returns its pid';

CREATE FUNCTION tensile.stop_coordinator() RETURNS boolean
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].stop_coordinator(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.stop_coordinator() IS
'Stops the coordinator, ending every running job; the next call starts one with current settings';
REVOKE EXECUTE ON FUNCTION tensile.stop_coordinator() FROM PUBLIC;
