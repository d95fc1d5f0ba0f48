-- tensile_db 0.4.0 -> 0.5.0: the aggregates that read training data, in C.
\echo Use "ALTER EXTENSION tensile_db UPDATE TO '0.5.0'" to load this file. \quit

-- The aggregates that read training data (extension/tensile_db.c) ---------------------------------
-- tensile._pack_float4(real), _pack_float8(double precision), _pack_int8(bigint): every non-NULL
-- value, big-endian, in one bytea (NULL over no values): the bytes of string_agg(float4send(x), '')
-- (float8send, int8send) without a bytea per value; tensile._pack_float4_columns(VARIADIC "any"):
-- several real columns, one call a row; tensile._pack_text(text): a categorical column
-- dictionary-encoded (its distinct values' UTF-8 bytes, then a code a row, -1 for NULL). The
-- training scan uses them when present.
CREATE FUNCTION tensile._pack4_transfn(internal, real) RETURNS internal
    AS 'MODULE_PATHNAME', 'tensile_pack4_transfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._pack8_transfn(internal, double precision) RETURNS internal
    AS 'MODULE_PATHNAME', 'tensile_pack8_transfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._pack8_transfn(internal, bigint) RETURNS internal
    AS 'MODULE_PATHNAME', 'tensile_pack8_transfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._packcolumns_transfn(internal, VARIADIC "any") RETURNS internal
    AS 'MODULE_PATHNAME', 'tensile_packcolumns_transfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._packcolumns_finalfn(internal) RETURNS bytea
    AS 'MODULE_PATHNAME', 'tensile_packcolumns_finalfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._packtext_transfn(internal, text) RETURNS internal
    AS 'MODULE_PATHNAME', 'tensile_packtext_transfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._packtext_finalfn(internal) RETURNS bytea
    AS 'MODULE_PATHNAME', 'tensile_packtext_finalfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE FUNCTION tensile._pack_finalfn(internal) RETURNS bytea
    AS 'MODULE_PATHNAME', 'tensile_pack_finalfn' LANGUAGE C CALLED ON NULL INPUT IMMUTABLE PARALLEL SAFE;
CREATE AGGREGATE tensile._pack_float4(real) (
    SFUNC = tensile._pack4_transfn, STYPE = internal, FINALFUNC = tensile._pack_finalfn);
CREATE AGGREGATE tensile._pack_float8(double precision) (
    SFUNC = tensile._pack8_transfn, STYPE = internal, FINALFUNC = tensile._pack_finalfn);
CREATE AGGREGATE tensile._pack_int8(bigint) (
    SFUNC = tensile._pack8_transfn, STYPE = internal, FINALFUNC = tensile._pack_finalfn);
CREATE AGGREGATE tensile._pack_float4_columns(VARIADIC "any") (
    SFUNC = tensile._packcolumns_transfn, STYPE = internal, FINALFUNC = tensile._packcolumns_finalfn);
CREATE AGGREGATE tensile._pack_text(text) (
    SFUNC = tensile._packtext_transfn, STYPE = internal, FINALFUNC = tensile._packtext_finalfn);
COMMENT ON AGGREGATE tensile._pack_float4(real) IS
    'every non-NULL value as float4send writes it, in one bytea: the training scan''s reader of a real column';
COMMENT ON AGGREGATE tensile._pack_float8(double precision) IS
    'every non-NULL value as float8send writes it, in one bytea: the training scan''s reader of a label';
COMMENT ON AGGREGATE tensile._pack_int8(bigint) IS
    'every non-NULL value as int8send writes it, in one bytea: the training scan''s reader of a row key';
COMMENT ON FUNCTION tensile._pack4_transfn(internal, real) IS 'Appends one real to a pack aggregate''s buffer (internal)';
COMMENT ON FUNCTION tensile._pack8_transfn(internal, double precision) IS
    'Appends one double precision to a pack aggregate''s buffer (internal)';
COMMENT ON FUNCTION tensile._pack8_transfn(internal, bigint) IS 'Appends one bigint to a pack aggregate''s buffer (internal)';
COMMENT ON AGGREGATE tensile._pack_float4_columns(VARIADIC "any") IS
    'several real columns, none NULL, in one bytea, one column after another: the training scan''s reader of numeric features';
COMMENT ON FUNCTION tensile._packcolumns_transfn(internal, VARIADIC "any") IS
    'Appends one row of real columns to a columns pack (internal)';
COMMENT ON FUNCTION tensile._packcolumns_finalfn(internal) IS 'A columns pack''s buffers as one bytea (internal)';
COMMENT ON AGGREGATE tensile._pack_text(text) IS
    'a categorical column dictionary-encoded in one bytea (its distinct values, then a code a row): the training scan''s reader of it';
COMMENT ON FUNCTION tensile._packtext_transfn(internal, text) IS
    'Appends the code of one text (or NULL) to a categorical pack (internal)';
COMMENT ON FUNCTION tensile._packtext_finalfn(internal) IS 'A categorical pack''s values and codes as one bytea (internal)';
COMMENT ON FUNCTION tensile._pack_finalfn(internal) IS 'A pack aggregate''s buffer as one bytea (internal)';
