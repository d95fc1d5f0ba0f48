/*
 * tensile_db.c: the module's magic block, and the aggregates with which tensile_db 0.5.0 and 0.6.0
 * read training data (since 0.7.0 reader.c reads it; these stay for the install and upgrade
 * scripts of those versions, whose functions name them).
 *
 * tensile._pack_float4(real), tensile._pack_float8(double precision) and tensile._pack_int8(bigint)
 * append each non-NULL value, big-endian, to one growing buffer and return it as one bytea: the
 * same bytes as string_agg(float4send(x), '') (float8send, int8send), NULLs skipped likewise, and
 * NULL over no values, without a palloc'd bytea per value nor string_agg's delimiter.
 * tensile._pack_float4_columns(VARIADIC "any") reads several real columns in one call a row, and
 * tensile._pack_text(text) dictionary-encodes a categorical column as it reads it (below). The buffer
 * lives in the aggregate's memory context and grows by doubling (StringInfo), so the scan
 * allocates about twice the result at most, and a result beyond MaxAllocSize (1 GB) raises
 * PostgreSQL's own error (SQLSTATE 54000), as string_agg's does.
 *
 * The varlena header is kept in the buffer's first VARHDRSZ bytes, so the final function returns
 * the buffer itself instead of building another; calling it again (a window aggregate) sets the
 * same header.
 */
#include "postgres.h"

#include "fmgr.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "port/pg_bswap.h"
#include "common/hashfn.h"
#include "catalog/pg_type_d.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(tensile_pack4_transfn);
PG_FUNCTION_INFO_V1(tensile_pack8_transfn);
PG_FUNCTION_INFO_V1(tensile_packcolumns_transfn);
PG_FUNCTION_INFO_V1(tensile_packcolumns_finalfn);
PG_FUNCTION_INFO_V1(tensile_packtext_transfn);
PG_FUNCTION_INFO_V1(tensile_packtext_finalfn);
PG_FUNCTION_INFO_V1(tensile_pack_finalfn);

/* The memory context of the aggregate calling a transition function: its state's home. */
static MemoryContext
aggregate_context(FunctionCallInfo fcinfo)
{
	MemoryContext aggcontext;

	if (!AggCheckCallContext(fcinfo, &aggcontext))
		elog(ERROR, "tensile_db's pack aggregates must be called as aggregates");
	return aggcontext;
}

/* The state of one aggregate: a StringInfo whose data starts with VARHDRSZ reserved bytes. */
static StringInfo
pack_state(FunctionCallInfo fcinfo)
{
	MemoryContext aggcontext = aggregate_context(fcinfo);
	MemoryContext old;
	StringInfo	state;

	if (!PG_ARGISNULL(0))
		return (StringInfo) PG_GETARG_POINTER(0);
	old = MemoryContextSwitchTo(aggcontext);
	state = makeStringInfo();
	MemoryContextSwitchTo(old);
	state->len = VARHDRSZ;
	return state;
}

static inline void
append_be(StringInfo state, const void *value, int nbytes)
{
	if (state->len + nbytes >= state->maxlen)
		enlargeStringInfo(state, nbytes);
	memcpy(state->data + state->len, value, nbytes);
	state->len += nbytes;
}

/* One real's 4 bytes, big-endian (float4send's). */
static inline void
append_float4(StringInfo state, float4 value)
{
	uint32		bits;

	memcpy(&bits, &value, sizeof(bits));
	bits = pg_hton32(bits);
	append_be(state, &bits, sizeof(bits));
}

/* real (float4) in, its 4 bytes big-endian appended. */
Datum
tensile_pack4_transfn(PG_FUNCTION_ARGS)
{
	StringInfo	state;

	if (PG_ARGISNULL(1))
	{
		if (PG_ARGISNULL(0))
			PG_RETURN_NULL();
		PG_RETURN_POINTER(PG_GETARG_POINTER(0));
	}
	state = pack_state(fcinfo);
	append_float4(state, PG_GETARG_FLOAT4(1));
	PG_RETURN_POINTER(state);
}

/* double precision (float8) or bigint (int8) in, its 8 bytes big-endian appended: both are read
 * as the int64 of their bits (by value on 64-bit builds, through the pointer elsewhere). */
Datum
tensile_pack8_transfn(PG_FUNCTION_ARGS)
{
	StringInfo	state;
	uint64		bits;

	if (PG_ARGISNULL(1))
	{
		if (PG_ARGISNULL(0))
			PG_RETURN_NULL();
		PG_RETURN_POINTER(PG_GETARG_POINTER(0));
	}
	bits = pg_hton64((uint64) PG_GETARG_INT64(1));
	state = pack_state(fcinfo);
	append_be(state, &bits, sizeof(bits));
	PG_RETURN_POINTER(state);
}

/*
 * tensile._pack_float4_columns(VARIADIC "any"): several real columns in one aggregate, one call a
 * row instead of one a column: each argument must be real and not NULL (the scan casts each
 * column and reads only complete rows, a NULL kept for imputation as NaN). The result: the first
 * column's values, big-endian, then the second's, and so on (NULL over no rows).
 */
typedef struct ColumnsPack
{
	int			ncolumns;
	StringInfoData columns[FLEXIBLE_ARRAY_MEMBER];	/* one buffer a column, each from its start */
} ColumnsPack;

Datum
tensile_packcolumns_transfn(PG_FUNCTION_ARGS)
{
	MemoryContext aggcontext = aggregate_context(fcinfo);
	ColumnsPack *state;
	int			ncolumns = PG_NARGS() - 1;
	int			i;

	if (PG_ARGISNULL(0))
	{
		MemoryContext old = MemoryContextSwitchTo(aggcontext);

		for (i = 1; i <= ncolumns; i++)
			if (get_fn_expr_argtype(fcinfo->flinfo, i) != FLOAT4OID)
				elog(ERROR, "tensile._pack_float4_columns reads real columns only (argument %d)", i);
		state = palloc(offsetof(ColumnsPack, columns) + ncolumns * sizeof(StringInfoData));
		state->ncolumns = ncolumns;
		for (i = 0; i < ncolumns; i++)
			initStringInfo(&state->columns[i]);
		MemoryContextSwitchTo(old);
	}
	else
		state = (ColumnsPack *) PG_GETARG_POINTER(0);
	for (i = 0; i < ncolumns; i++)
	{
		if (PG_ARGISNULL(i + 1))
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("tensile._pack_float4_columns got a NULL in argument %d", i + 1)));
		append_float4(&state->columns[i], PG_GETARG_FLOAT4(i + 1));
	}
	PG_RETURN_POINTER(state);
}

Datum
tensile_packcolumns_finalfn(PG_FUNCTION_ARGS)
{
	ColumnsPack *state;
	Size		nbytes = VARHDRSZ;
	bytea	   *result;
	char	   *at;
	int			i;

	if (PG_ARGISNULL(0))
		PG_RETURN_NULL();
	state = (ColumnsPack *) PG_GETARG_POINTER(0);
	for (i = 0; i < state->ncolumns; i++)
		nbytes += state->columns[i].len;
	if (nbytes >= MaxAllocSize)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%d real columns take %zu bytes, over %zu", state->ncolumns, nbytes, (Size) MaxAllocSize)));
	result = palloc(nbytes);
	SET_VARSIZE(result, nbytes);
	at = VARDATA(result);
	for (i = 0; i < state->ncolumns; i++)
	{
		memcpy(at, state->columns[i].data, state->columns[i].len);
		at += state->columns[i].len;
	}
	PG_RETURN_BYTEA_P(result);
}

/*
 * tensile._pack_text(text): a categorical column, dictionary-encoded as it is read. Each distinct
 * value (its UTF-8 bytes, what convert_to(x, 'UTF8') gives, in the same checks of the database's
 * encoding) gets the next code, in order of first appearance; each row appends its value's code
 * (-1 for NULL). The result: the number of distinct values (int4), each one's byte length (int4)
 * and bytes, then one code (int4) a row; integers big-endian. One hash lookup a row in C, where
 * decoding one length-prefixed value a row took Python about a microsecond.
 */
typedef struct PackKey
{
	const char *bytes;			/* a copy in the aggregate's context, once entered */
	int			nbytes;
} PackKey;

typedef struct PackEntry
{
	PackKey		key;
	int32		code;
} PackEntry;

typedef struct TextPack
{
	HTAB	   *codes_of;		/* PackKey -> PackEntry */
	StringInfoData values;		/* VARHDRSZ + 4 reserved bytes, then each distinct value's length and bytes */
	StringInfoData codes;		/* one big-endian int4 a row */
	int32		distinct;
	MemoryContext context;		/* the aggregate's */
} TextPack;

static uint32
pack_key_hash(const void *key, Size keysize)
{
	const PackKey *k = (const PackKey *) key;

	return hash_bytes((const unsigned char *) k->bytes, k->nbytes);
}

static int
pack_key_match(const void *a, const void *b, Size keysize)
{
	const PackKey *x = (const PackKey *) a;
	const PackKey *y = (const PackKey *) b;

	return x->nbytes == y->nbytes && memcmp(x->bytes, y->bytes, x->nbytes) == 0 ? 0 : 1;
}

static TextPack *
text_pack_state(FunctionCallInfo fcinfo)
{
	MemoryContext aggcontext = aggregate_context(fcinfo);
	MemoryContext old;
	TextPack   *state;
	HASHCTL		ctl;

	if (!PG_ARGISNULL(0))
		return (TextPack *) PG_GETARG_POINTER(0);
	old = MemoryContextSwitchTo(aggcontext);
	state = palloc0(sizeof(TextPack));
	state->context = aggcontext;
	initStringInfo(&state->values);
	state->values.len = VARHDRSZ + sizeof(int32);
	initStringInfo(&state->codes);
	ctl.keysize = sizeof(PackKey);
	ctl.entrysize = sizeof(PackEntry);
	ctl.hash = pack_key_hash;
	ctl.match = pack_key_match;
	ctl.hcxt = aggcontext;
	state->codes_of = hash_create("tensile_db categories", 64, &ctl,
								  HASH_ELEM | HASH_FUNCTION | HASH_COMPARE | HASH_CONTEXT);
	MemoryContextSwitchTo(old);
	return state;
}

Datum
tensile_packtext_transfn(PG_FUNCTION_ARGS)
{
	TextPack   *state = text_pack_state(fcinfo);
	uint32		code = (uint32) -1;

	if (!PG_ARGISNULL(1))
	{
		text	   *value = PG_GETARG_TEXT_PP(1);
		PackKey		key;
		PackEntry  *entry;
		bool		found;

		key.nbytes = VARSIZE_ANY_EXHDR(value);
		key.bytes = pg_server_to_any(VARDATA_ANY(value), key.nbytes, PG_UTF8);
		if (key.bytes != VARDATA_ANY(value))
			key.nbytes = strlen(key.bytes);
		entry = (PackEntry *) hash_search(state->codes_of, &key, HASH_ENTER, &found);
		if (!found)
		{
			char	   *copy = MemoryContextAlloc(state->context, key.nbytes + 1);
			uint32		length = pg_hton32((uint32) key.nbytes);

			memcpy(copy, key.bytes, key.nbytes);
			entry->key.bytes = copy;
			entry->code = state->distinct++;
			append_be(&state->values, &length, sizeof(length));
			append_be(&state->values, key.bytes, key.nbytes);
		}
		code = (uint32) entry->code;
	}
	code = pg_hton32(code);
	append_be(&state->codes, &code, sizeof(code));
	PG_RETURN_POINTER(state);
}

/* The distinct values and the codes as one bytea (NULL when no row was read). */
Datum
tensile_packtext_finalfn(PG_FUNCTION_ARGS)
{
	TextPack   *state;
	bytea	   *result;
	uint32		distinct;

	if (PG_ARGISNULL(0))
		PG_RETURN_NULL();
	state = (TextPack *) PG_GETARG_POINTER(0);
	if ((Size) state->values.len + state->codes.len >= MaxAllocSize)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("a categorical column's values and codes take %d + %d bytes, over %zu",
						state->values.len, state->codes.len, (Size) MaxAllocSize)));
	result = palloc(state->values.len + state->codes.len);
	distinct = pg_hton32((uint32) state->distinct);
	memcpy(state->values.data + VARHDRSZ, &distinct, sizeof(distinct));
	memcpy(result, state->values.data, state->values.len);
	memcpy((char *) result + state->values.len, state->codes.data, state->codes.len);
	SET_VARSIZE(result, state->values.len + state->codes.len);
	PG_RETURN_BYTEA_P(result);
}

/* The buffer as a bytea (NULL when no value was appended). */
Datum
tensile_pack_finalfn(PG_FUNCTION_ARGS)
{
	StringInfo	state;

	if (PG_ARGISNULL(0))
		PG_RETURN_NULL();
	state = (StringInfo) PG_GETARG_POINTER(0);
	SET_VARSIZE(state->data, state->len);
	PG_RETURN_BYTEA_P((bytea *) state->data);
}
