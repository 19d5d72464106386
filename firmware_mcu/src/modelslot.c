#include "modelslot.h"

#include <string.h>

#include "edgelink.h"

static const uint8_t META_MAGIC[4] = {'E', 'M', 'S', '1'};
static const uint8_t MANIFEST_MAGIC[4] = {'E', 'M', 'M', '1'};

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v & 0xFFu);
    p[1] = (uint8_t)((v >> 8) & 0xFFu);
    p[2] = (uint8_t)((v >> 16) & 0xFFu);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

uint32_t ms_storage_size(uint32_t slot_size)
{
    return 2u * MS_META_SECTOR + 2u * slot_size;
}

static uint32_t slot_addr(const modelslot *ms, uint8_t slot)
{
    return 2u * MS_META_SECTOR + (uint32_t)slot * ms->slot_size;
}

ms_status ms_parse_manifest(const uint8_t raw[MS_MANIFEST_LEN], ms_manifest *out)
{
    if (raw == NULL || out == NULL) {
        return MS_ERR_ARG;
    }
    if (memcmp(raw, MANIFEST_MAGIC, 4) != 0) {
        return MS_ERR_BAD_MANIFEST;
    }
    out->version = get_u32(raw + 4);
    out->size = get_u32(raw + 8);
    out->flags = get_u32(raw + 12);
    memcpy(out->sha256, raw + 16, 32);
    memcpy(out->name, raw + 48, MS_NAME_LEN);
    if (out->version == 0 || out->size == 0 || out->flags != 0) {
        return MS_ERR_BAD_MANIFEST;
    }
    return MS_OK;
}

static void encode_meta(const ms_meta *m, uint8_t out[MS_META_RECORD_LEN])
{
    int i;
    uint8_t *p;
    memcpy(out, META_MAGIC, 4);
    put_u32(out + 4, m->seq);
    out[8] = m->active;
    out[9] = m->trial;
    out[10] = m->previous;
    out[11] = 0;
    put_u32(out + 12, m->min_version);
    for (i = 0; i < 2; i++) {
        p = out + 16 + 56 * i;
        put_u32(p, m->slot[i].version);
        put_u32(p + 4, m->slot[i].size);
        memcpy(p + 8, m->slot[i].sha256, 32);
        memcpy(p + 40, m->slot[i].name, MS_NAME_LEN);
    }
    put_u32(out + 128, el_crc32c(0, out, 128));
}

static int decode_meta(const uint8_t in[MS_META_RECORD_LEN], ms_meta *m)
{
    int i;
    const uint8_t *p;
    if (memcmp(in, META_MAGIC, 4) != 0 || el_crc32c(0, in, 128) != get_u32(in + 128)) {
        return 0;
    }
    m->seq = get_u32(in + 4);
    m->active = in[8];
    m->trial = in[9];
    m->previous = in[10];
    m->min_version = get_u32(in + 12);
    for (i = 0; i < 2; i++) {
        p = in + 16 + 56 * i;
        m->slot[i].version = get_u32(p);
        m->slot[i].size = get_u32(p + 4);
        memcpy(m->slot[i].sha256, p + 8, 32);
        memcpy(m->slot[i].name, p + 40, MS_NAME_LEN);
    }
    if ((m->active > 1 && m->active != MS_NO_SLOT) || (m->previous > 1 && m->previous != MS_NO_SLOT)) {
        return 0;
    }
    return 1;
}

/* Write the next record into the other copy; the current one stays valid until this one is whole. */
static ms_status store_meta(modelslot *ms, const ms_meta *next)
{
    uint8_t rec[MS_META_RECORD_LEN];
    ms_meta m = *next;
    uint8_t copy = (uint8_t)(ms->meta_copy ^ 1u);
    uint32_t addr = (uint32_t)copy * MS_META_SECTOR;
    m.seq = ms->meta.seq + 1u;
    encode_meta(&m, rec);
    if (ms->storage->erase(ms->storage->ctx, addr, MS_META_SECTOR) != 0 ||
        ms->storage->write(ms->storage->ctx, addr, rec, MS_META_RECORD_LEN) != 0) {
        return MS_ERR_STORAGE;
    }
    ms->meta = m;
    ms->meta_copy = copy;
    return MS_OK;
}

ms_status ms_init(modelslot *ms, const ms_storage *storage, uint32_t slot_size, const ms_key *keys, size_t key_count)
{
    uint8_t rec[MS_META_RECORD_LEN];
    ms_meta copies[2];
    int valid[2];
    uint8_t i;
    if (ms == NULL || storage == NULL || storage->read == NULL || storage->write == NULL ||
        storage->erase == NULL || (keys == NULL && key_count > 0) || key_count > MS_MAX_KEYS || slot_size == 0) {
        return MS_ERR_ARG;
    }
    if (sodium_init() < 0) {
        return MS_ERR_CRYPTO;
    }
    memset(ms, 0, sizeof *ms);
    ms->storage = storage;
    ms->slot_size = slot_size;
    if (key_count > 0) {
        memcpy(ms->keys, keys, key_count * sizeof *keys);
    }
    ms->key_count = key_count;
    for (i = 0; i < 2; i++) {
        if (storage->read(storage->ctx, (uint32_t)i * MS_META_SECTOR, rec, MS_META_RECORD_LEN) != 0) {
            return MS_ERR_STORAGE;
        }
        valid[i] = decode_meta(rec, &copies[i]);
    }
    if (valid[0] && (!valid[1] || (int32_t)(copies[0].seq - copies[1].seq) > 0)) {
        ms->meta = copies[0];
        ms->meta_copy = 0;
    } else if (valid[1]) {
        ms->meta = copies[1];
        ms->meta_copy = 1;
    } else {
        memset(&ms->meta, 0, sizeof ms->meta);
        ms->meta.active = MS_NO_SLOT;
        ms->meta.previous = MS_NO_SLOT;
        ms->meta_copy = 1; /* the first record goes to copy 0 */
    }
    return MS_OK;
}

static const ms_key *find_key(const modelslot *ms, const uint8_t key_id[MS_KEY_ID_LEN])
{
    size_t i;
    for (i = 0; i < ms->key_count; i++) {
        if (memcmp(ms->keys[i].key_id, key_id, MS_KEY_ID_LEN) == 0) {
            return &ms->keys[i];
        }
    }
    return NULL;
}

ms_status ms_begin(modelslot *ms, const uint8_t manifest[MS_MANIFEST_LEN], const uint8_t key_id[MS_KEY_ID_LEN],
                   const uint8_t signature[MS_SIGNATURE_LEN], uint32_t *resume_offset)
{
    uint8_t prehash[crypto_generichash_BYTES_MAX];
    const ms_key *key;
    ms_manifest m;
    ms_meta next;
    ms_status st;
    uint32_t floor;
    uint8_t target;
    if (ms == NULL || manifest == NULL || key_id == NULL || signature == NULL || resume_offset == NULL) {
        return MS_ERR_ARG;
    }
    key = find_key(ms, key_id);
    if (key == NULL) {
        return MS_ERR_UNKNOWN_KEY;
    }
    /* minisign's prehashed form: the signature covers BLAKE2b-512 of the file. */
    if (crypto_generichash(prehash, sizeof prehash, manifest, MS_MANIFEST_LEN, NULL, 0) != 0 ||
        crypto_sign_verify_detached(signature, prehash, sizeof prehash, key->public_key) != 0) {
        return MS_ERR_BAD_SIGNATURE;
    }
    st = ms_parse_manifest(manifest, &m);
    if (st != MS_OK) {
        return st;
    }
    if (ms->receiving && memcmp(ms->pending_raw, manifest, MS_MANIFEST_LEN) == 0) {
        *resume_offset = ms->received;
        return MS_OK;
    }
    floor = ms->meta.min_version;
    if (ms->meta.active != MS_NO_SLOT && ms->meta.slot[ms->meta.active].version > floor) {
        floor = ms->meta.slot[ms->meta.active].version;
    }
    if (m.version <= floor) {
        return MS_ERR_ROLLBACK;
    }
    if (m.size > ms->slot_size) {
        return MS_ERR_TOO_LARGE;
    }
    if (ms->meta.trial) {
        return MS_ERR_ROLLBACK; /* the running trial must be committed or rolled back first */
    }
    ms->receiving = 0;
    target = ms->meta.active == 0 ? 1u : 0u;
    /* Forget the old image of the target slot before erasing it, so a rollback never points at half an image. */
    if (ms->meta.slot[target].version != 0 || ms->meta.previous == target) {
        next = ms->meta;
        memset(&next.slot[target], 0, sizeof next.slot[target]);
        if (next.previous == target) {
            next.previous = MS_NO_SLOT;
        }
        st = store_meta(ms, &next);
        if (st != MS_OK) {
            return st;
        }
    }
    if (ms->storage->erase(ms->storage->ctx, slot_addr(ms, target), ms->slot_size) != 0) {
        return MS_ERR_STORAGE;
    }
    ms->pending = m;
    memcpy(ms->pending_raw, manifest, MS_MANIFEST_LEN);
    ms->target = target;
    ms->received = 0;
    ms->receiving = 1;
    *resume_offset = 0;
    return MS_OK;
}

ms_status ms_write(modelslot *ms, uint32_t offset, const uint8_t *data, uint32_t len)
{
    if (ms == NULL || data == NULL || len == 0) {
        return MS_ERR_ARG;
    }
    if (!ms->receiving) {
        return MS_ERR_NO_SESSION;
    }
    if (offset != ms->received || len > ms->pending.size - ms->received) {
        return MS_ERR_BAD_OFFSET;
    }
    if (ms->storage->write(ms->storage->ctx, slot_addr(ms, ms->target) + offset, data, len) != 0) {
        ms->receiving = 0;
        return MS_ERR_STORAGE;
    }
    ms->received += len;
    return MS_OK;
}

static ms_status hash_slot(modelslot *ms, uint8_t slot, uint32_t size, uint8_t out[32])
{
    uint8_t buf[MS_IO_CHUNK];
    crypto_hash_sha256_state state;
    uint32_t done = 0, n;
    crypto_hash_sha256_init(&state);
    while (done < size) {
        n = size - done < MS_IO_CHUNK ? size - done : MS_IO_CHUNK;
        if (ms->storage->read(ms->storage->ctx, slot_addr(ms, slot) + done, buf, n) != 0) {
            return MS_ERR_STORAGE;
        }
        crypto_hash_sha256_update(&state, buf, n);
        done += n;
    }
    crypto_hash_sha256_final(&state, out);
    return MS_OK;
}

ms_status ms_finish(modelslot *ms)
{
    uint8_t digest[32];
    ms_meta next;
    ms_status st;
    if (ms == NULL) {
        return MS_ERR_ARG;
    }
    if (!ms->receiving) {
        return MS_ERR_NO_SESSION;
    }
    if (ms->received != ms->pending.size) {
        return MS_ERR_INCOMPLETE;
    }
    ms->receiving = 0;
    /* Hash what the flash holds, not what was sent: a bad write shows up here. */
    st = hash_slot(ms, ms->target, ms->pending.size, digest);
    if (st != MS_OK) {
        return st;
    }
    if (sodium_memcmp(digest, ms->pending.sha256, 32) != 0) {
        return MS_ERR_HASH_MISMATCH;
    }
    next = ms->meta;
    next.slot[ms->target].version = ms->pending.version;
    next.slot[ms->target].size = ms->pending.size;
    memcpy(next.slot[ms->target].sha256, ms->pending.sha256, 32);
    memcpy(next.slot[ms->target].name, ms->pending.name, MS_NAME_LEN);
    next.previous = ms->meta.active;
    next.active = ms->target;
    next.trial = 1;
    return store_meta(ms, &next);
}

ms_status ms_commit(modelslot *ms)
{
    ms_meta next;
    if (ms == NULL) {
        return MS_ERR_ARG;
    }
    if (!ms->meta.trial) {
        return MS_ERR_NOT_TRIAL;
    }
    next = ms->meta;
    next.trial = 0;
    next.min_version = next.slot[next.active].version;
    return store_meta(ms, &next);
}

ms_status ms_rollback(modelslot *ms)
{
    ms_meta next;
    if (ms == NULL) {
        return MS_ERR_ARG;
    }
    if (!ms->meta.trial) {
        return MS_ERR_NOT_TRIAL;
    }
    next = ms->meta;
    next.trial = 0;
    next.active = ms->meta.previous;
    next.previous = MS_NO_SLOT;
    return store_meta(ms, &next);
}

ms_status ms_verify_slot(modelslot *ms, uint8_t slot)
{
    uint8_t digest[32];
    ms_status st;
    if (ms == NULL || slot > 1) {
        return MS_ERR_ARG;
    }
    if (ms->meta.slot[slot].version == 0) {
        return MS_ERR_NO_IMAGE;
    }
    st = hash_slot(ms, slot, ms->meta.slot[slot].size, digest);
    if (st != MS_OK) {
        return st;
    }
    return sodium_memcmp(digest, ms->meta.slot[slot].sha256, 32) == 0 ? MS_OK : MS_ERR_HASH_MISMATCH;
}

ms_status ms_active(const modelslot *ms, uint8_t *slot, ms_slot_info *info)
{
    if (ms == NULL || slot == NULL || info == NULL) {
        return MS_ERR_ARG;
    }
    if (ms->meta.active == MS_NO_SLOT) {
        return MS_ERR_NO_IMAGE;
    }
    *slot = ms->meta.active;
    *info = ms->meta.slot[ms->meta.active];
    return MS_OK;
}

ms_status ms_read_image(modelslot *ms, uint8_t slot, uint32_t offset, uint8_t *buf, uint32_t len)
{
    if (ms == NULL || buf == NULL || slot > 1) {
        return MS_ERR_ARG;
    }
    if (ms->meta.slot[slot].version == 0) {
        return MS_ERR_NO_IMAGE;
    }
    if (offset > ms->meta.slot[slot].size || len > ms->meta.slot[slot].size - offset) {
        return MS_ERR_BAD_OFFSET;
    }
    return ms->storage->read(ms->storage->ctx, slot_addr(ms, slot) + offset, buf, len) == 0 ? MS_OK
                                                                                              : MS_ERR_STORAGE;
}
