/* modelslot: signed updates into two slots, commit, rollback, and a power cut at every storage write. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "modelslot.h"

#define SLOT_SIZE (4u * MS_META_SECTOR)
#define FLASH_SIZE (2u * MS_META_SECTOR + 2u * SLOT_SIZE)

/* RAM flash with NOR semantics; after `ops_left` writes or erases the power is cut (torn last write). */
typedef struct {
    uint8_t mem[FLASH_SIZE];
    long ops_left;
    int cut;
    unsigned long ops;
} ram_flash;

static int spend(ram_flash *f)
{
    if (f->cut) {
        return -1;
    }
    if (f->ops_left == 0) {
        f->cut = 1;
        return -1;
    }
    if (f->ops_left > 0) {
        f->ops_left--;
    }
    f->ops++;
    return 0;
}

static int rf_read(void *ctx, uint32_t addr, uint8_t *buf, uint32_t len)
{
    ram_flash *f = ctx;
    if (addr > FLASH_SIZE || len > FLASH_SIZE - addr) {
        return -1;
    }
    memcpy(buf, f->mem + addr, len);
    return 0;
}

static int rf_write(void *ctx, uint32_t addr, const uint8_t *buf, uint32_t len)
{
    ram_flash *f = ctx;
    uint32_t i, limit = len;
    if (addr > FLASH_SIZE || len > FLASH_SIZE - addr) {
        return -1;
    }
    if (spend(f) != 0) {
        if (!f->cut) {
            return -1;
        }
        limit = len / 2;
    }
    for (i = 0; i < limit; i++) {
        f->mem[addr + i] &= buf[i];
    }
    return limit == len ? 0 : -1;
}

static int rf_erase(void *ctx, uint32_t addr, uint32_t len)
{
    ram_flash *f = ctx;
    if (addr > FLASH_SIZE || len > FLASH_SIZE - addr || spend(f) != 0) {
        return -1;
    }
    memset(f->mem + addr, 0xFF, len);
    return 0;
}

static ram_flash flash;
static ms_storage storage = {&flash, rf_read, rf_write, rf_erase};
static ms_key key;
static uint8_t secret[crypto_sign_SECRETKEYBYTES];
static ms_key other_key;
static uint8_t other_secret[crypto_sign_SECRETKEYBYTES];

typedef struct {
    uint8_t manifest[MS_MANIFEST_LEN];
    uint8_t signature[MS_SIGNATURE_LEN];
    uint8_t key_id[MS_KEY_ID_LEN];
    uint8_t image[3 * MS_META_SECTOR + 123];
    uint32_t size;
} release;

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Sign as minisign -S does: Ed25519 over BLAKE2b-512 of the manifest. */
static void sign_release(release *r, const uint8_t *sk, const ms_key *k)
{
    uint8_t h[64];
    crypto_generichash(h, sizeof h, r->manifest, MS_MANIFEST_LEN, NULL, 0);
    crypto_sign_detached(r->signature, NULL, h, sizeof h, sk);
    memcpy(r->key_id, k->key_id, MS_KEY_ID_LEN);
}

static void make_release(release *r, uint32_t version, uint32_t size, uint8_t fill)
{
    uint32_t i;
    memset(r, 0, sizeof *r);
    r->size = size;
    for (i = 0; i < size; i++) {
        r->image[i] = (uint8_t)(fill + i * 31u);
    }
    memcpy(r->manifest, "EMM1", 4);
    put_u32(r->manifest + 4, version);
    put_u32(r->manifest + 8, size);
    crypto_hash_sha256(r->manifest + 16, r->image, size);
    memcpy(r->manifest + 48, "test-model", 10);
    sign_release(r, secret, &key);
}

static ms_status send_release(modelslot *ms, const release *r, uint32_t chunk)
{
    uint32_t off = 0, n;
    ms_status st = ms_begin(ms, r->manifest, r->key_id, r->signature, &off);
    while (st == MS_OK && off < r->size) {
        n = r->size - off < chunk ? r->size - off : chunk;
        st = ms_write(ms, off, r->image + off, n);
        off += n;
    }
    return st == MS_OK ? ms_finish(ms) : st;
}

static void fresh_flash(void)
{
    memset(flash.mem, 0xFF, sizeof flash.mem);
    flash.ops_left = -1;
    flash.cut = 0;
    flash.ops = 0;
}

static int setup(void **state)
{
    (void)state;
    fresh_flash();
    return 0;
}

static uint32_t active_version(modelslot *ms)
{
    uint8_t slot;
    ms_slot_info info;
    return ms_active(ms, &slot, &info) == MS_OK ? info.version : 0;
}

static void test_update_commit_and_reboot(void **state)
{
    modelslot ms, again;
    release r;
    uint8_t slot, back[64];
    ms_slot_info info;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    assert_int_equal(ms_active(&ms, &slot, &info), MS_ERR_NO_IMAGE);
    make_release(&r, 1, sizeof r.image, 1);
    assert_int_equal(send_release(&ms, &r, 200), MS_OK);
    assert_true(ms.meta.trial);
    assert_int_equal(ms_commit(&ms), MS_OK);
    assert_int_equal(ms_init(&again, &storage, SLOT_SIZE, &key, 1), MS_OK);
    assert_int_equal(ms_active(&again, &slot, &info), MS_OK);
    assert_int_equal(info.version, 1);
    assert_int_equal(info.size, sizeof r.image);
    assert_false(again.meta.trial);
    assert_int_equal(again.meta.min_version, 1);
    assert_int_equal(ms_read_image(&again, slot, 100, back, sizeof back), MS_OK);
    assert_memory_equal(back, r.image + 100, sizeof back);
    assert_int_equal(ms_verify_slot(&again, slot), MS_OK);
    /* The next update goes to the other slot. */
    make_release(&r, 2, 1000, 9);
    assert_int_equal(send_release(&again, &r, 236), MS_OK);
    assert_int_equal(again.meta.active, slot ^ 1u);
    assert_int_equal(again.meta.previous, slot);
}

static void test_refusals(void **state)
{
    modelslot ms;
    release r;
    uint32_t off = 0;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    make_release(&r, 5, 500, 2);
    /* Unknown key, tampered manifest, signature by another key under our key id. */
    sign_release(&r, other_secret, &other_key);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_UNKNOWN_KEY);
    make_release(&r, 5, 500, 2);
    r.manifest[20] ^= 1;
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_BAD_SIGNATURE);
    make_release(&r, 5, 500, 2);
    sign_release(&r, other_secret, &key);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_BAD_SIGNATURE);
    /* Signed but malformed, and too large for a slot. */
    make_release(&r, 5, 500, 2);
    memcpy(r.manifest, "XMM1", 4);
    sign_release(&r, secret, &key);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_BAD_MANIFEST);
    make_release(&r, 5, 500, 2);
    put_u32(r.manifest + 8, SLOT_SIZE + 1);
    sign_release(&r, secret, &key);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_TOO_LARGE);
    /* A tampered image is found when the stored bytes are hashed, and nothing becomes active. */
    make_release(&r, 5, 500, 2);
    r.image[77] ^= 0x40;
    assert_int_equal(send_release(&ms, &r, 100), MS_ERR_HASH_MISMATCH);
    assert_int_equal(active_version(&ms), 0);
    /* Chunks out of order, past the end, and with no session. */
    make_release(&r, 5, 500, 2);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_OK);
    assert_int_equal(ms_write(&ms, 10, r.image, 10), MS_ERR_BAD_OFFSET);
    assert_int_equal(ms_write(&ms, 0, r.image, 501), MS_ERR_BAD_OFFSET);
    assert_int_equal(ms_finish(&ms), MS_ERR_INCOMPLETE);
    assert_int_equal(ms_write(&ms, 0, r.image, 500), MS_OK);
    assert_int_equal(ms_finish(&ms), MS_OK);
    assert_int_equal(ms_write(&ms, 500, r.image, 1), MS_ERR_NO_SESSION);
    /* An update while the trial runs, then versions at or below the committed one. */
    make_release(&r, 6, 500, 3);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_ROLLBACK);
    assert_int_equal(ms_commit(&ms), MS_OK);
    make_release(&r, 5, 500, 3);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_ROLLBACK);
    make_release(&r, 4, 500, 3);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_ERR_ROLLBACK);
}

static void test_resume_after_link_drop(void **state)
{
    modelslot ms;
    release r;
    uint32_t off = 99;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    make_release(&r, 3, 2000, 4);
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_OK);
    assert_int_equal(off, 0);
    assert_int_equal(ms_write(&ms, 0, r.image, 700), MS_OK);
    /* The same manifest again: carry on from 700, nothing re-erased. */
    assert_int_equal(ms_begin(&ms, r.manifest, r.key_id, r.signature, &off), MS_OK);
    assert_int_equal(off, 700);
    assert_int_equal(ms_write(&ms, 700, r.image + 700, 1300), MS_OK);
    assert_int_equal(ms_finish(&ms), MS_OK);
    assert_int_equal(ms_verify_slot(&ms, ms.meta.active), MS_OK);
}

static void test_rollback_returns_to_previous(void **state)
{
    modelslot ms, again;
    release r;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    make_release(&r, 1, 900, 5);
    assert_int_equal(send_release(&ms, &r, 64), MS_OK);
    assert_int_equal(ms_commit(&ms), MS_OK);
    make_release(&r, 2, 1900, 6);
    assert_int_equal(send_release(&ms, &r, 64), MS_OK);
    assert_int_equal(active_version(&ms), 2);
    assert_int_equal(ms_rollback(&ms), MS_OK);
    assert_int_equal(active_version(&ms), 1);
    assert_int_equal(ms_verify_slot(&ms, ms.meta.active), MS_OK);
    assert_int_equal(ms_rollback(&ms), MS_ERR_NOT_TRIAL);
    assert_int_equal(ms_init(&again, &storage, SLOT_SIZE, &key, 1), MS_OK);
    assert_int_equal(active_version(&again), 1);
    assert_int_equal(again.meta.min_version, 1);
}

/*
 * Install v1, then cut the power at every storage operation of the v2 update in turn. After each
 * cut a reboot finds a model that verifies: v1, or v2 on trial once its metadata was written whole.
 */
static void test_power_cut_at_every_write(void **state)
{
    modelslot ms;
    release v1, v2;
    uint8_t base[FLASH_SIZE];
    unsigned long total, cut;
    int saw_old = 0, saw_new = 0;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    make_release(&v1, 1, 3000, 7);
    assert_int_equal(send_release(&ms, &v1, 200), MS_OK);
    assert_int_equal(ms_commit(&ms), MS_OK);
    make_release(&v2, 2, sizeof v2.image, 8);
    memcpy(base, flash.mem, sizeof base);
    /* How many operations a whole update takes. */
    flash.ops = 0;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    assert_int_equal(send_release(&ms, &v2, 200), MS_OK);
    total = flash.ops;
    assert_true(total > 10);
    for (cut = 0; cut < total; cut++) {
        uint32_t v;
        memcpy(flash.mem, base, sizeof base);
        flash.cut = 0;
        flash.ops_left = (long)cut;
        assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
        assert_int_not_equal(send_release(&ms, &v2, 200), MS_OK);
        assert_true(flash.cut);
        /* Reboot with power back. */
        flash.cut = 0;
        flash.ops_left = -1;
        assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
        v = active_version(&ms);
        assert_true(v == 1 || v == 2);
        if (v == 2) {
            assert_true(ms.meta.trial);
            saw_new++;
        } else {
            assert_false(ms.meta.trial);
            saw_old++;
        }
        assert_int_equal(ms_verify_slot(&ms, ms.meta.active), MS_OK);
        assert_int_equal(ms.meta.min_version, 1);
    }
    assert_true(saw_old > 0);
    /* The last operation is the metadata write: cut in half, the old record stands. */
    assert_int_equal(saw_new, 0);
}

static void test_torn_commit_keeps_a_valid_record(void **state)
{
    modelslot ms;
    release r;
    uint32_t v;
    (void)state;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    make_release(&r, 1, 800, 1);
    assert_int_equal(send_release(&ms, &r, 100), MS_OK);
    assert_int_equal(ms_commit(&ms), MS_OK);
    make_release(&r, 2, 800, 2);
    assert_int_equal(send_release(&ms, &r, 100), MS_OK);
    /* Cut during commit's write (its erase passes): the trial record survives, and it still verifies. */
    flash.ops_left = 1;
    assert_int_equal(ms_commit(&ms), MS_ERR_STORAGE);
    flash.cut = 0;
    flash.ops_left = -1;
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    v = active_version(&ms);
    assert_int_equal(v, 2);
    assert_true(ms.meta.trial);
    assert_int_equal(ms.meta.min_version, 1);
    assert_int_equal(ms_rollback(&ms), MS_OK);
    assert_int_equal(active_version(&ms), 1);
    assert_int_equal(ms_verify_slot(&ms, ms.meta.active), MS_OK);
}

static void test_arguments(void **state)
{
    modelslot ms;
    ms_storage broken = storage;
    uint32_t off;
    uint8_t zero[64] = {0};
    (void)state;
    broken.read = NULL;
    assert_int_equal(ms_init(&ms, &broken, SLOT_SIZE, &key, 1), MS_ERR_ARG);
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, MS_MAX_KEYS + 1), MS_ERR_ARG);
    assert_int_equal(ms_init(&ms, &storage, 0, &key, 1), MS_ERR_ARG);
    assert_int_equal(ms_init(&ms, &storage, SLOT_SIZE, &key, 1), MS_OK);
    assert_int_equal(ms_begin(&ms, zero, zero, zero, NULL), MS_ERR_ARG);
    assert_int_equal(ms_begin(&ms, zero, key.key_id, zero, &off), MS_ERR_BAD_SIGNATURE);
    assert_int_equal(ms_finish(&ms), MS_ERR_NO_SESSION);
    assert_int_equal(ms_commit(&ms), MS_ERR_NOT_TRIAL);
}

int main(void)
{
    uint8_t pk[crypto_sign_PUBLICKEYBYTES];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_update_commit_and_reboot, setup),
        cmocka_unit_test_setup(test_refusals, setup),
        cmocka_unit_test_setup(test_resume_after_link_drop, setup),
        cmocka_unit_test_setup(test_rollback_returns_to_previous, setup),
        cmocka_unit_test_setup(test_power_cut_at_every_write, setup),
        cmocka_unit_test_setup(test_torn_commit_keeps_a_valid_record, setup),
        cmocka_unit_test_setup(test_arguments, setup),
    };
    if (sodium_init() < 0) {
        return 1;
    }
    crypto_sign_keypair(pk, secret);
    memcpy(key.public_key, pk, sizeof pk);
    memcpy(key.key_id, "KEYID001", MS_KEY_ID_LEN);
    crypto_sign_keypair(pk, other_secret);
    memcpy(other_key.public_key, pk, sizeof pk);
    memcpy(other_key.key_id, "KEYID002", MS_KEY_ID_LEN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
