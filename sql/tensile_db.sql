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
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- one per version
    name          text NOT NULL CHECK (name <> '' AND length(name) <= 63),
    owner         name NOT NULL DEFAULT current_user,               -- the same for every version of a name
    task          text NOT NULL CHECK (task IN ('classification', 'regression')),
    architecture  jsonb NOT NULL,
    options       jsonb NOT NULL,
    feature_names text[] NOT NULL,
    label_name    text NOT NULL,
    label_classes double precision[],          -- classification: the class of each output, in order
    metrics       jsonb NOT NULL,
    weights       bytea NOT NULL,               -- numpy .npz of float32 arrays, no pickle
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- 0.3.0 (last, in the order ALTER TABLE adds them to an upgraded table):
    version       integer NOT NULL CHECK (version >= 1),  -- 1, 2, ... per name, in training order
    deployed      boolean NOT NULL DEFAULT false,         -- the version predictions use; one per name
    preprocess    jsonb,                        -- raw feature columns to the network's input; NULL: all numeric
    label_names   text[],                       -- a text or enum label's class names, in label_classes order
    search        jsonb,                        -- a hyperparameter search's trial: {"search", "trial", "params"}
    UNIQUE (name, version)
);
CREATE UNIQUE INDEX models_one_deployed ON tensile.models (name) WHERE deployed;
COMMENT ON TABLE tensile.models IS
'Trained models, one row per version: architecture, options, features, classes, metrics and weights; '
'predictions use the deployed version of a name';
COMMENT ON COLUMN tensile.models.id IS 'The row of one version; predictions of a session notice a new id';
COMMENT ON COLUMN tensile.models.version IS 'The version number within the name: 1, 2, ... in training order';
COMMENT ON COLUMN tensile.models.deployed IS
'Whether predictions use this version; at most one version of a name (tensile.deploy changes it)';
COMMENT ON COLUMN tensile.models.label_classes IS
'Classification: the class of each output, in order (0 .. C-1 when label_names names them)';
COMMENT ON COLUMN tensile.models.label_names IS
'The class names of a text or enum label, in label_classes order; NULL for a numeric label';
COMMENT ON COLUMN tensile.models.preprocess IS
'How the raw feature columns become the network''s input; NULL for models trained before 0.3.0 (every feature numeric)';
COMMENT ON COLUMN tensile.models.search IS
'For a trial of a hyperparameter search: {"search": its id, "trial": its number, "params": the values tried}; NULL otherwise';
COMMENT ON COLUMN tensile.models.metrics IS
'Training metrics; "score" (higher is better) and "score_name" rank versions for deployment';
SELECT pg_catalog.pg_extension_config_dump('tensile.models', '');
SELECT pg_catalog.pg_extension_config_dump('tensile.models_id_seq', '');

-- Which version of a name was deployed when, and how. tensile.deploy(name, 'rollback') deploys the
-- version of the latest deployment that is not the deployed one (so two rollbacks in a row return
-- to where they started). A version's rows go with it.
CREATE TABLE tensile.deployments (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL,
    owner       name NOT NULL DEFAULT current_user,               -- the model's owner
    model_id    bigint NOT NULL REFERENCES tensile.models (id) ON DELETE CASCADE,
    version     integer NOT NULL,
    strategy    text NOT NULL CHECK (strategy IN ('train', 'version', 'best_score', 'most_recent', 'rollback')),
    deployed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deployments_name ON tensile.deployments (name, id);
CREATE INDEX deployments_model_id ON tensile.deployments (model_id);
COMMENT ON TABLE tensile.deployments IS
'Deployments of model versions, latest last: by training (train), by number (version), or by a strategy '
'(best_score, most_recent, rollback)';
SELECT pg_catalog.pg_extension_config_dump('tensile.deployments', '');
SELECT pg_catalog.pg_extension_config_dump('tensile.deployments_id_seq', '');

-- A model is visible to its owner and to members of the owning role (train as a group role, or
-- GRANT your role, to share); only its owner may create, replace, deploy or drop it. Models reveal
-- facts about their training data (label classes, column means), so nothing is public by default.
-- Its deployments are visible to the same roles.
ALTER TABLE tensile.models ENABLE ROW LEVEL SECURITY;
CREATE POLICY models_visible ON tensile.models FOR SELECT USING (
    owner OPERATOR(pg_catalog.=) current_user
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) owner AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')));
CREATE POLICY models_owned ON tensile.models FOR ALL
    USING (owner OPERATOR(pg_catalog.=) current_user) WITH CHECK (owner OPERATOR(pg_catalog.=) current_user);
ALTER TABLE tensile.deployments ENABLE ROW LEVEL SECURITY;
CREATE POLICY deployments_visible ON tensile.deployments FOR SELECT USING (
    owner OPERATOR(pg_catalog.=) current_user
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) owner AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')));
CREATE POLICY deployments_owned ON tensile.deployments FOR ALL
    USING (owner OPERATOR(pg_catalog.=) current_user) WITH CHECK (owner OPERATOR(pg_catalog.=) current_user);
GRANT USAGE ON SCHEMA tensile TO PUBLIC;
-- Rows are written only by the extension, through tensile._write_model() (below), which checks
-- what it writes; roles read the rows row-level security shows them.
REVOKE ALL ON tensile.models FROM PUBLIC;
GRANT SELECT ON tensile.models TO PUBLIC;
REVOKE ALL ON tensile.deployments FROM PUBLIC;
GRANT SELECT ON tensile.deployments TO PUBLIC;

-- Model names are unique across roles (every version of a name has one owner), so training checks
-- a name against every model, visible or not; this reveals a name's owner and nothing else.
CREATE FUNCTION tensile._model_owner(model_name text) RETURNS name
LANGUAGE sql STABLE STRICT PARALLEL SAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT owner FROM tensile.models WHERE name OPERATOR(pg_catalog.=) model_name LIMIT 1
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
-- The one way rows reach tensile.models and tensile.deployments: it applies the write that the
-- extension's own code staged in this session (tensile_db.pg.registry) after validating it, and
-- nothing else; called directly it finds nothing staged and raises.

CREATE FUNCTION tensile._write_model() RETURNS bigint
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].write_model(plpy, GD)
$$;
COMMENT ON FUNCTION tensile._write_model() IS
'Applies the registry write staged by train_model, deploy or drop_model in this session; returns the '
'number of model versions it added, deployed or deleted (internal)';

-- Training ---------------------------------------------------------------------------------------

CREATE PROCEDURE tensile.train_model(
    model_name   text,
    source       text,
    label        text,
    features     text[] DEFAULT NULL,
    architecture jsonb DEFAULT '{"layers": [{"dense": 64, "activation": "relu"}]}',
    options      jsonb DEFAULT '{}',
    INOUT task   text DEFAULT NULL,
    INOUT metrics jsonb DEFAULT NULL,
    INOUT version integer DEFAULT NULL,
    INOUT deployed boolean DEFAULT NULL)
LANGUAGE plpython3u AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].train_model(plpy, GD, model_name, source, label, features, architecture, options)
$$;
COMMENT ON PROCEDURE tensile.train_model(text, text, text, text[], jsonb, jsonb, text, jsonb, integer, boolean) IS
'Trains a model on the rows of source (a query or table name) to predict label from features '
'(default: every other column: numeric, categorical (one-hot), or one numeric array), holding out '
'options.test_size of the rows (0.2) to measure it, on the shared coordinator, and stores it in '
'tensile.models as the next version of model_name; returns task, metrics, the version and whether it was deployed '
'(options.deploy: auto, the default, deploys it when its score is at least the deployed version''s; '
'always; never)';

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

-- The same for one row given by its raw column values, as a JSON object ({"column": value, ...}),
-- preprocessed as in training.
CREATE FUNCTION tensile.predict(model_name text, features jsonb) RETURNS double precision
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict(text, jsonb) IS
'Predicts one row given as a JSON object of its column values, on the CPU of this backend: the class '
'label (classification) or the value (regression)';

CREATE FUNCTION tensile.predict_proba(model_name text, features jsonb) RETURNS real[]
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_proba(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict_proba(text, jsonb) IS
'Class probabilities of one row given as a JSON object of its column values, in the order of '
'tensile.models.label_classes';

CREATE FUNCTION tensile.predict_label(model_name text, features real[]) RETURNS text
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_label(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict_label(text, real[]) IS
'The predicted class of one row by its name: the label''s value as the training data had it '
'(tensile.models.label_names for a text or enum label)';

CREATE FUNCTION tensile.predict_label(model_name text, features jsonb) RETURNS text
LANGUAGE plpython3u STABLE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_label(plpy, GD, model_name, features)
$$;
COMMENT ON FUNCTION tensile.predict_label(text, jsonb) IS
'The predicted class of one row given as a JSON object of its column values, by its name: the label''s '
'value as the training data had it (tensile.models.label_names for a text or enum label)';

-- A table row itself (tensile.predict('m', t) FROM t): PL/Python refuses arguments of type record,
-- so these PL/pgSQL wrappers pass the row on as to_jsonb(row).
CREATE FUNCTION tensile.predict(model_name text, features record) RETURNS double precision
LANGUAGE plpgsql STABLE STRICT PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN RETURN tensile.predict(model_name, pg_catalog.to_jsonb(features)); END
$$;
COMMENT ON FUNCTION tensile.predict(text, record) IS
'Predicts one table row (tensile.predict(''m'', t) FROM t), read by column name and preprocessed as in '
'training: the class label (classification) or the value (regression)';

CREATE FUNCTION tensile.predict_proba(model_name text, features record) RETURNS real[]
LANGUAGE plpgsql STABLE STRICT PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN RETURN tensile.predict_proba(model_name, pg_catalog.to_jsonb(features)); END
$$;
COMMENT ON FUNCTION tensile.predict_proba(text, record) IS
'Class probabilities of one table row, in the order of tensile.models.label_classes';

CREATE FUNCTION tensile.predict_label(model_name text, features record) RETURNS text
LANGUAGE plpgsql STABLE STRICT PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN RETURN tensile.predict_label(model_name, pg_catalog.to_jsonb(features)); END
$$;
COMMENT ON FUNCTION tensile.predict_label(text, record) IS
'The predicted class of one table row by its name (tensile.models.label_names for a text label)';

CREATE FUNCTION tensile.predict_batch(model_name text, source text, key text DEFAULT NULL,
                                      options jsonb DEFAULT '{}')
RETURNS TABLE (id bigint, prediction double precision, probabilities real[], class_name text)
-- STABLE: every SPI query of one call sees the calling statement's snapshot, so the model row, its
-- weights and the source are read as of one moment.
LANGUAGE plpython3u STABLE CALLED ON NULL INPUT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].predict_batch(plpy, GD, model_name, source, key, options)
$$;
COMMENT ON FUNCTION tensile.predict_batch(text, text, text, jsonb) IS
'Predicts every row of source (a query or table name, read as the calling role) on the coordinator''s '
'device, streaming batches through the layers with a prefetch window: id (the key column, or the row''s '
'ordinal), the class label (for a text label, its index in label_names) or value, the class '
'probabilities and class_name, the class by its name as predict_label gives it (both NULL for regression). '
'Options: window (integer >= 1 or "all"; default tensile.prefetch_window), batch_size, cache, skip_nulls';

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
COMMENT ON FUNCTION tensile.drop_model(text) IS
'Deletes every version of a model the current role owns, and their deployments';

-- Deployment -------------------------------------------------------------------------------------

CREATE FUNCTION tensile.deploy(model_name text, version integer) RETURNS integer
LANGUAGE plpython3u VOLATILE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].deploy(plpy, GD, model_name, version)
$$;
COMMENT ON FUNCTION tensile.deploy(text, integer) IS
'Deploys a version of a model the current role owns: predictions of model_name use it from then on; '
'records it in tensile.deployments and returns the version';

CREATE FUNCTION tensile.deploy(model_name text, strategy text) RETURNS integer
LANGUAGE plpython3u VOLATILE STRICT PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].deploy(plpy, GD, model_name, strategy)
$$;
COMMENT ON FUNCTION tensile.deploy(text, text) IS
'Deploys the version of a model the current role owns that strategy picks: best_score (the highest '
'metrics score, the higher version on a tie, versions without a score last), most_recent (the highest '
'version) or rollback (the version of the latest earlier deployment); records it in tensile.deployments '
'and returns the version';

-- The coordinator --------------------------------------------------------------------------------

CREATE FUNCTION tensile.job_status(
    OUT job_id integer, OUT backend_pid integer, OUT role text, OUT model_name text, OUT state text,
    OUT device text, OUT epoch integer, OUT epochs integer, OUT loss double precision,
    OUT device_bytes bigint, OUT peak_device_bytes bigint, OUT vanilla_peak_bytes bigint,
    OUT swapped_out_bytes bigint, OUT swapped_in_bytes bigint, OUT host_bytes bigint, OUT disk_bytes bigint,
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
'caller is a member of, or for superusers and pg_monitor): the device it runs or waits on (tensile.device, or '
'the one of tensile.devices placement chose), progress, device and swapped bytes, the bytes '
'held in host memory and in the disk tier (its spill file), the scheduler '
'policy, whether the job runs on a plan (schedule: cold start, planned or reactive), and its counts of '
'planned swap-ins, passive (unplanned) swap-ins and recomputes';
CREATE VIEW tensile.jobs AS SELECT * FROM tensile.job_status();
GRANT SELECT ON tensile.jobs TO PUBLIC;
COMMENT ON VIEW tensile.jobs IS
'Live training jobs of every backend: state, device, epoch, loss, device bytes, swapped, host and disk bytes, policy, '
'schedule, planned and passive swap-ins, recomputes';

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
    OUT compactions bigint, OUT compacted_bytes bigint, OUT served_models integer, OUT served_host_bytes bigint,
    OUT rss_bytes bigint, OUT peak_rss_bytes bigint,
    OUT host_budget_bytes bigint, OUT host_used_bytes bigint, OUT host_peak_bytes bigint,
    OUT host_cache_bytes bigint, OUT disk_bytes bigint, OUT spill_file_bytes bigint,
    OUT disk_read_bytes_per_s double precision, OUT disk_write_bytes_per_s double precision,
    OUT served_file_bytes bigint, OUT disk_free_bytes bigint)
RETURNS SETOF record
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].memory(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.memory_status() IS
'One row per device the coordinator drives (tensile.device, or each of tensile.devices): '
'the device arena: budget, bytes in use, high-water mark since the coordinator started, per-job bytes; '
'and the scheduler: policy, host-to-device and device-to-host bandwidth measured at start (bytes per '
'second), plans made, and the latest plan''s predicted peak bytes and extra seconds per period; '
'and the planned pool: its state (idle, recording, planning, serving, or general only), the bytes its '
'region holds, plans installed, allocations served by lookup, mismatches that sent requests back to the '
'general pool, and for the last recorded period the planned arena, the lower bound (max live bytes) and '
'the highest byte the best-fit general pool touches on the same trace; per_job carries the same three '
'for each job alone; and batch inference on that device: predict calls running or waiting for device memory, the '
'device bytes they hold, the bytes of model layers kept in the weight cache (counted in in_use_bytes '
'too), layer loads host to device, '
'layer uses served from the cache, and cached layers evicted for room; per_job names models only as '
'tensile.job_status does; and the arena compactions made and the bytes they moved, the model versions '
'open (their layers read from their files) and the host bytes the model store holds (scaling arrays, read '
'buffers in use); and the coordinator process''s resident set and its high-water '
'mark (from /proc), which on a CPU host the device budget does not bound; and the tiers under the '
'device: the host budget (tensile.host_budget), the host bytes in use (swapped-out copies, copies in '
'flight and cached model layers) and their high-water mark, the cached layers'' bytes, the bytes in the '
'disk tier and the extent of the spill files, the spill directory''s read and write bandwidth measured '
'at start (bytes per second), the bytes of the served models'' files, and the bytes free on the spill '
'directory''s file system (tensile.spill_dir) now';
CREATE VIEW tensile.memory AS SELECT * FROM tensile.memory_status();
GRANT SELECT ON tensile.memory TO PUBLIC;
COMMENT ON VIEW tensile.memory IS
'One row per device: budget, in use, peak, host bytes, fragmentation, per job; the scheduler: policy, '
'bandwidths, plans made, predicted peak and extra time; the planned pool: state, region, lookups, '
'mismatches, planned arena against its lower bound and the general pool; batch inference: running '
'calls, their bytes, the weight cache''s bytes, loads, hits and evictions; compactions and the models '
'open; the coordinator''s resident set; the host budget, host and disk tier bytes, '
'spill files, disk bandwidths, model files and the disk tier''s free bytes';

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

-- The scan that reads training and prediction data (extension/reader.c) ------------------------------
-- tensile._read_columns runs one query (the statement the backend builds around a source, as the
-- calling role) and writes what its output columns read of the statement's columns (columns: a
-- 1-based statement column each; kinds: one letter each, f real, d double precision, i bigint,
-- t text dictionary-encoded, a real[]), in native byte order, into the memory file the backend
-- made and passes as scan_fd (memfd_create, named tensile_db-scan; any other file is refused):
-- only the rows where no output column flagged in `required` reads a NULL (and, with skip_holes,
-- no array holds a NULL element). Returns the layout of the file and the rows counted, as JSON.
-- At most max_nbytes are written, never more than 1 GB (SQLSTATE 54000 beyond).
CREATE FUNCTION tensile._read_columns(statement text, columns integer[], kinds text, required boolean[],
                                      width integer, skip_holes boolean, want_kept boolean, scan_fd integer,
                                      max_nbytes bigint)
    RETURNS text
    AS 'MODULE_PATHNAME', 'tensile_read_columns' LANGUAGE C CALLED ON NULL INPUT VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION tensile._read_columns(text, integer[], text, boolean[], integer, boolean, boolean, integer, bigint) IS
    'Reads the columns of one query into the backend''s scan file: the training and prediction scans'' reader (internal)';
