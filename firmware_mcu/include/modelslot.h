/*
 * modelslot: two model slots in flash, signed updates, commit and rollback.
 *
 * Compile-time options (define before including, or with -D):
 *   MS_MAX_KEYS        provisioned release keys (default 4)
 *   MS_META_SECTOR     bytes reserved for each of the two metadata copies (default 4096, one flash sector)
 *   MS_IO_CHUNK        bytes read at a time when an image is hashed (default 256, on the stack)
 *
 * Storage layout: [meta copy 0][meta copy 1][slot 0][slot 1]. The metadata is written to the
 * copy that does not hold the newest record, with a sequence number and a CRC-32C, so a power
 * cut during any write leaves the previous record valid. An image is written only to the slot
 * that is not active, and the slot is marked empty before it is erased.
 *
 * A release is a 64-byte manifest (little-endian):
 *   magic "EMM1" | model_version:u32 | image_size:u32 | flags:u32 | image_sha256[32] | model_name[16]
 * signed like `minisign -S` (prehashed): Ed25519 over BLAKE2b-512(manifest) by a provisioned key.
 * Versions only go up: a manifest at or below the committed version counter is refused.
 */
#ifndef MODELSLOT_H
#define MODELSLOT_H

#include <stddef.h>
#include <stdint.h>

#include <sodium.h>

#ifndef MS_MAX_KEYS
#define MS_MAX_KEYS 4
#endif
#ifndef MS_META_SECTOR
#define MS_META_SECTOR 4096u
#endif
#ifndef MS_IO_CHUNK
#define MS_IO_CHUNK 256u
#endif

#define MS_MANIFEST_LEN 64u
#define MS_KEY_ID_LEN 8u
#define MS_PUBLIC_KEY_LEN 32u
#define MS_SIGNATURE_LEN 64u
#define MS_NAME_LEN 16u
#define MS_NO_SLOT 0xFFu
#define MS_META_RECORD_LEN 132u

typedef enum {
    MS_OK = 0,
    MS_ERR_ARG = 1,
    MS_ERR_STORAGE = 2,        /* a storage read, write or erase failed; the session is aborted */
    MS_ERR_UNKNOWN_KEY = 3,
    MS_ERR_BAD_SIGNATURE = 4,
    MS_ERR_BAD_MANIFEST = 5,
    MS_ERR_ROLLBACK = 6,       /* version not above the active one or the committed counter */
    MS_ERR_TOO_LARGE = 7,      /* image larger than a slot */
    MS_ERR_NO_SESSION = 8,
    MS_ERR_BAD_OFFSET = 9,     /* a chunk not at the next expected offset, or past the image */
    MS_ERR_INCOMPLETE = 10,
    MS_ERR_HASH_MISMATCH = 11, /* the stored image does not hash to the signed value */
    MS_ERR_NOT_TRIAL = 12,
    MS_ERR_NO_IMAGE = 13,
    MS_ERR_CRYPTO = 14         /* sodium_init failed */
} ms_status;

/* Return 0 on success. Erase sets bytes to 0xFF; write may only clear bits (NOR flash). */
typedef struct {
    void *ctx;
    int (*read)(void *ctx, uint32_t addr, uint8_t *buf, uint32_t len);
    int (*write)(void *ctx, uint32_t addr, const uint8_t *buf, uint32_t len);
    int (*erase)(void *ctx, uint32_t addr, uint32_t len);
} ms_storage;

typedef struct {
    uint8_t key_id[MS_KEY_ID_LEN];
    uint8_t public_key[MS_PUBLIC_KEY_LEN];
} ms_key;

typedef struct {
    uint32_t version; /* 0: empty */
    uint32_t size;
    uint8_t sha256[32];
    char name[MS_NAME_LEN];
} ms_slot_info;

typedef struct {
    uint32_t seq;
    uint8_t active;      /* MS_NO_SLOT before the first update */
    uint8_t trial;       /* active is on trial: commit or roll back */
    uint8_t previous;    /* what a rollback returns to */
    uint32_t min_version; /* monotonic counter: the highest committed version */
    ms_slot_info slot[2];
} ms_meta;

typedef struct {
    uint32_t version;
    uint32_t size;
    uint32_t flags;
    uint8_t sha256[32];
    char name[MS_NAME_LEN];
} ms_manifest;

typedef struct {
    const ms_storage *storage;
    uint32_t slot_size;
    ms_key keys[MS_MAX_KEYS];
    size_t key_count;
    ms_meta meta;
    uint8_t meta_copy; /* which copy holds meta */
    /* the update in progress */
    uint8_t receiving;
    uint8_t target;
    uint32_t received;
    ms_manifest pending;
    uint8_t pending_raw[MS_MANIFEST_LEN];
} modelslot;

ms_status ms_parse_manifest(const uint8_t raw[MS_MANIFEST_LEN], ms_manifest *out);

/* Read the newest valid metadata copy; a blank store starts empty. slot_size must be a multiple of the sector. */
ms_status ms_init(modelslot *ms, const ms_storage *storage, uint32_t slot_size, const ms_key *keys, size_t key_count);

/* Verify the signed manifest and start writing the inactive slot; the same manifest again resumes. */
ms_status ms_begin(modelslot *ms, const uint8_t manifest[MS_MANIFEST_LEN], const uint8_t key_id[MS_KEY_ID_LEN],
                   const uint8_t signature[MS_SIGNATURE_LEN], uint32_t *resume_offset);
ms_status ms_write(modelslot *ms, uint32_t offset, const uint8_t *data, uint32_t len);
/* Hash what is stored against the manifest, then make it the active slot, on trial. */
ms_status ms_finish(modelslot *ms);
/* The trial model works: keep it and raise the version counter to it. */
ms_status ms_commit(modelslot *ms);
/* The trial model failed (or never committed before a reset): back to the previous slot. */
ms_status ms_rollback(modelslot *ms);
/* Re-hash a slot's stored image against its recorded hash. */
ms_status ms_verify_slot(modelslot *ms, uint8_t slot);

/* The active model; MS_ERR_NO_IMAGE before the first update. */
ms_status ms_active(const modelslot *ms, uint8_t *slot, ms_slot_info *info);
ms_status ms_read_image(modelslot *ms, uint8_t slot, uint32_t offset, uint8_t *buf, uint32_t len);

uint32_t ms_storage_size(uint32_t slot_size);

#endif
