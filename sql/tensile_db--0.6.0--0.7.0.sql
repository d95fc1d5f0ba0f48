-- tensile_db 0.6.0 -> 0.7.0: the scan that reads training and prediction data writes each column
-- straight into a memory file the backend maps (tensile._read_columns, extension/reader.c) instead
-- of aggregating it into a bytea; the aggregates that did are dropped (their C functions stay in
-- the module for the install scripts of 0.5.0 and 0.6.0).
\echo Use "ALTER EXTENSION tensile_db UPDATE TO '0.7.0'" to load this file. \quit

DROP AGGREGATE tensile._pack_float4(real);
DROP AGGREGATE tensile._pack_float8(double precision);
DROP AGGREGATE tensile._pack_int8(bigint);
DROP AGGREGATE tensile._pack_float4_columns(VARIADIC "any");
DROP AGGREGATE tensile._pack_text(text);
DROP FUNCTION tensile._pack4_transfn(internal, real);
DROP FUNCTION tensile._pack8_transfn(internal, double precision);
DROP FUNCTION tensile._pack8_transfn(internal, bigint);
DROP FUNCTION tensile._packcolumns_transfn(internal, VARIADIC "any");
DROP FUNCTION tensile._packcolumns_finalfn(internal);
DROP FUNCTION tensile._packtext_transfn(internal, text);
DROP FUNCTION tensile._packtext_finalfn(internal);
DROP FUNCTION tensile._pack_finalfn(internal);

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
