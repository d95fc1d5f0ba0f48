-- tensile_db 0.1.0 -> 0.2.0: hardening for a shared database (see the install script's notes).
\echo Use "ALTER EXTENSION tensile_db UPDATE TO '0.2.0'" to load this file. \quit

-- The registry is written only through tensile._write_model(); roles read what row-level security
-- shows them.
REVOKE ALL ON tensile.models FROM PUBLIC;
GRANT SELECT ON tensile.models TO PUBLIC;
DROP POLICY models_visible ON tensile.models;
CREATE POLICY models_visible ON tensile.models FOR SELECT USING (
    owner OPERATOR(pg_catalog.=) current_user
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) owner AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')));
DROP POLICY models_owned ON tensile.models;
CREATE POLICY models_owned ON tensile.models FOR ALL
    USING (owner OPERATOR(pg_catalog.=) current_user) WITH CHECK (owner OPERATOR(pg_catalog.=) current_user);

-- SECURITY DEFINER functions: search_path pinned with pg_temp last, operators qualified.
CREATE OR REPLACE FUNCTION tensile._model_owner(model_name text) RETURNS name
LANGUAGE sql STABLE STRICT PARALLEL SAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT owner FROM tensile.models WHERE name OPERATOR(pg_catalog.=) model_name
$$;

CREATE OR REPLACE FUNCTION tensile._server_setting(setting_name text) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT setting FROM pg_catalog.pg_file_settings
    WHERE name OPERATOR(pg_catalog.=) setting_name AND setting_name OPERATOR(pg_catalog.~~) 'tensile.%'
      AND applied AND error IS NULL
    ORDER BY seqno DESC LIMIT 1
$$;

CREATE FUNCTION tensile._write_model() RETURNS bigint
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].write_model(plpy, GD)
$$;
COMMENT ON FUNCTION tensile._write_model() IS
'Applies the registry write staged by train_model or drop_model in this session (internal)';

-- The status views are readable by every role; the functions behind them hide other roles' jobs.
GRANT SELECT ON tensile.jobs TO PUBLIC;
COMMENT ON FUNCTION tensile.job_status() IS
'Live jobs of every backend, from the coordinator (role, model_name and loss only for jobs of roles the '
'caller is a member of, or for superusers and pg_monitor): progress, device and swapped bytes, the scheduler '
'policy, whether the job runs on a plan (schedule: cold start, planned or reactive), and its counts of '
'planned swap-ins, passive (unplanned) swap-ins and recomputes';

-- tensile.memory gains compactions, compacted_bytes, served_models and served_host_bytes: the row
-- type of its function changes, so both are made anew.
DROP VIEW tensile.memory;
DROP FUNCTION tensile.memory_status();
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
