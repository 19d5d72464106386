/* edgelink: framing, the streaming decoder and the typed messages; then the vectors Python wrote. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "edgelink.h"
#include "el_describe.h"
#include "vectors_json.h"

static const char *vectors_path = "tests/vectors/python_vectors.json";

/* xorshift: deterministic pseudo-random bytes for the property tests. */
static uint32_t rng_state = 0x12345678u;
static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static void test_crc32c_check_value(void **state)
{
    (void)state;
    assert_int_equal(el_crc32c(0, (const uint8_t *)"123456789", 9), 0xE3069283u);
    /* Streaming the CRC in two parts gives the one-shot value. */
    assert_int_equal(el_crc32c(el_crc32c(0, (const uint8_t *)"1234", 4), (const uint8_t *)"56789", 5), 0xE3069283u);
}

static void test_cobs_known_values(void **state)
{
    static const uint8_t in1[] = {0x11, 0x22, 0x00, 0x33};
    static const uint8_t want1[] = {0x03, 0x11, 0x22, 0x02, 0x33};
    static const uint8_t in2[] = {0x00, 0x00};
    static const uint8_t want2[] = {0x01, 0x01, 0x01};
    uint8_t in3[254], out[300], back[300];
    size_t n = 0, m = 0, i;
    (void)state;
    assert_int_equal(el_cobs_encode(in1, sizeof in1, out, sizeof out, &n), EL_OK);
    assert_int_equal(n, sizeof want1);
    assert_memory_equal(out, want1, n);
    assert_int_equal(el_cobs_encode(in2, sizeof in2, out, sizeof out, &n), EL_OK);
    assert_int_equal(n, sizeof want2);
    assert_memory_equal(out, want2, n);
    for (i = 0; i < sizeof in3; i++) {
        in3[i] = (uint8_t)(i + 1);
    }
    /* 254 non-zero bytes: one full group, no trailing code byte. */
    assert_int_equal(el_cobs_encode(in3, sizeof in3, out, sizeof out, &n), EL_OK);
    assert_int_equal(n, 255);
    assert_int_equal(out[0], 0xFF);
    assert_int_equal(el_cobs_decode(out, n, back, sizeof back, &m), EL_OK);
    assert_int_equal(m, sizeof in3);
    assert_memory_equal(back, in3, m);
    /* A code byte pointing past the end, and a zero inside: not COBS. */
    out[0] = 0x05;
    assert_int_equal(el_cobs_decode(out, 3, back, sizeof back, &m), EL_ERR_COBS);
    assert_int_equal(el_cobs_encode(in1, sizeof in1, out, 3, &n), EL_ERR_SPACE);
}

static void test_cobs_round_trip_property(void **state)
{
    uint8_t in[600], enc[700], dec[700];
    size_t len, n, m, i;
    int round;
    (void)state;
    for (round = 0; round < 2000; round++) {
        len = rng() % sizeof in;
        for (i = 0; i < len; i++) {
            /* Mostly zeros or mostly non-zero, to hit both short and full groups. */
            in[i] = (round & 1) ? (uint8_t)(rng() % 4 == 0 ? 0 : rng()) : (uint8_t)(1 + rng() % 255);
        }
        assert_int_equal(el_cobs_encode(in, len, enc, sizeof enc, &n), EL_OK);
        assert_null(memchr(enc, 0, n));
        assert_int_equal(el_cobs_decode(enc, n, dec, sizeof dec, &m), EL_OK);
        assert_int_equal(m, len);
        assert_memory_equal(dec, in, len);
    }
}

static el_rx_result feed(el_decoder *d, const uint8_t *data, size_t len, el_frame *f, int *frames, int *errors)
{
    size_t i;
    el_rx_result r, last = EL_RX_PENDING;
    for (i = 0; i < len; i++) {
        r = el_decoder_push(d, data[i], f);
        if (r == EL_RX_FRAME) {
            (*frames)++;
            last = r;
        } else if (r != EL_RX_PENDING) {
            (*errors)++;
            last = r;
        }
    }
    return last;
}

static void test_every_message_round_trips(void **state)
{
    uint8_t out[EL_MAX_ENCODED], chunk[EL_MAX_CHUNK];
    el_message m, back;
    el_decoder d;
    el_frame f;
    size_t n = 0, i;
    int frames = 0, errors = 0;
    char a[2048], b[2048];
    static const uint8_t types[] = {EL_MSG_HELLO, EL_MSG_DETECTION, EL_MSG_HEARTBEAT, EL_MSG_LOG, EL_MSG_OTA_BEGIN,
                                    EL_MSG_OTA_CHUNK, EL_MSG_OTA_END, EL_MSG_ACK, EL_MSG_NACK};
    (void)state;
    for (i = 0; i < sizeof chunk; i++) {
        chunk[i] = (uint8_t)rng();
    }
    for (i = 0; i < sizeof types; i++) {
        memset(&m, 0, sizeof m);
        m.type = types[i];
        m.seq = (uint16_t)(1000 + i);
        m.u.hello.device_id = 0xDEADBEEFu; /* overlays the first bytes of every variant */
        if (m.type == EL_MSG_LOG) {
            m.u.log.text_len = 5;
            memcpy(m.u.log.text, "hello", 5);
        } else if (m.type == EL_MSG_OTA_CHUNK) {
            m.u.ota_chunk.offset = 77;
            m.u.ota_chunk.len = EL_MAX_CHUNK;
            m.u.ota_chunk.data = chunk;
        }
        assert_int_equal(el_message_encode(&m, out, sizeof out, &n), EL_OK);
        el_decoder_init(&d);
        assert_int_equal(feed(&d, out, n, &f, &frames, &errors), EL_RX_FRAME);
        assert_int_equal(f.type, m.type);
        assert_int_equal(f.seq, m.seq);
        assert_int_equal(el_message_decode(&f, &back), EL_OK);
        assert_int_equal(el_describe(&m, a, sizeof a), 0);
        assert_int_equal(el_describe(&back, b, sizeof b), 0);
        assert_string_equal(a, b);
    }
    assert_int_equal(errors, 0);
}

static void test_decoder_survives_garbage_truncation_and_resyncs(void **state)
{
    uint8_t frame[EL_MAX_ENCODED], junk[1000];
    el_message m;
    el_decoder d;
    el_frame f;
    size_t n = 0, i;
    int frames = 0, errors = 0;
    (void)state;
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_DETECTION;
    m.u.detection.class_id = 2;
    assert_int_equal(el_message_encode(&m, frame, sizeof frame, &n), EL_OK);
    el_decoder_init(&d);
    /* Join mid-frame: the tail is dropped as one bad frame, the next whole frame decodes. */
    feed(&d, frame + 3, n - 3, &f, &frames, &errors);
    assert_int_equal(frames, 0);
    assert_int_equal(errors, 1);
    assert_int_equal(feed(&d, frame, n, &f, &frames, &errors), EL_RX_FRAME);
    /* A run longer than any frame is dropped once as too long, and the decoder recovers. */
    memset(junk, 0x55, sizeof junk);
    feed(&d, junk, sizeof junk, &f, &frames, &errors);
    assert_int_equal(el_decoder_push(&d, 0, &f), EL_RX_TOO_LONG);
    assert_int_equal(feed(&d, frame, n, &f, &frames, &errors), EL_RX_FRAME);
    /* Each single flipped bit is caught. */
    for (i = 0; i + 1 < n; i++) {
        uint8_t bad[EL_MAX_ENCODED];
        el_rx_result r;
        int fr = 0, er = 0;
        memcpy(bad, frame, n);
        bad[i] ^= 0x01;
        el_decoder_init(&d);
        r = feed(&d, bad, n, &f, &fr, &er);
        assert_int_equal(fr, 0);
        assert_true(r >= EL_RX_TOO_LONG);
    }
    /* Random garbage followed by a frame: never more than the frame comes out, and the frame does. */
    for (i = 0; i < 500; i++) {
        size_t len = rng() % sizeof junk, j;
        int fr = 0, er = 0;
        for (j = 0; j < len; j++) {
            junk[j] = (uint8_t)rng();
        }
        el_decoder_init(&d);
        feed(&d, junk, len, &f, &fr, &er);
        fr = 0;
        feed(&d, (const uint8_t *)"\0", 1, &f, &fr, &er);
        assert_int_equal(feed(&d, frame, n, &f, &fr, &er), EL_RX_FRAME);
        assert_int_equal(fr, 1);
    }
}

static void test_streaming_equals_one_shot(void **state)
{
    /* Several frames pushed byte by byte decode to what each decodes to alone. */
    uint8_t stream[4 * EL_MAX_ENCODED];
    el_message m, back;
    el_decoder d;
    el_frame f;
    size_t n = 0, at = 0, i;
    uint16_t seen = 0;
    (void)state;
    for (i = 0; i < 4; i++) {
        memset(&m, 0, sizeof m);
        m.type = EL_MSG_HEARTBEAT;
        m.seq = (uint16_t)i;
        m.u.heartbeat.detections_sent = (uint32_t)(i * 0x01000100u);
        assert_int_equal(el_message_encode(&m, stream + at, sizeof stream - at, &n), EL_OK);
        at += n;
    }
    el_decoder_init(&d);
    for (i = 0; i < at; i++) {
        if (el_decoder_push(&d, stream[i], &f) == EL_RX_FRAME) {
            assert_int_equal(el_message_decode(&f, &back), EL_OK);
            assert_int_equal(back.seq, seen);
            assert_int_equal(back.u.heartbeat.detections_sent, (uint32_t)(seen * 0x01000100u));
            seen++;
        }
    }
    assert_int_equal(seen, 4);
}

static void test_length_and_type_errors(void **state)
{
    uint8_t payload[EL_MAX_PAYLOAD] = {0};
    el_frame f;
    el_message m;
    size_t n = 0;
    (void)state;
    f.payload = payload;
    f.seq = 0;
    f.type = EL_MSG_DETECTION;
    f.len = EL_DETECTION_LEN - 1;
    assert_int_equal(el_message_decode(&f, &m), EL_ERR_LENGTH);
    f.type = EL_MSG_OTA_CHUNK;
    f.len = EL_OTA_CHUNK_HEADER; /* a chunk with no data */
    assert_int_equal(el_message_decode(&f, &m), EL_ERR_LENGTH);
    f.type = EL_MSG_OTA_END;
    f.len = 1;
    assert_int_equal(el_message_decode(&f, &m), EL_ERR_LENGTH);
    f.type = EL_MSG_LOG;
    f.len = 0;
    assert_int_equal(el_message_decode(&f, &m), EL_ERR_LENGTH);
    f.type = 0x7F;
    f.len = 0;
    assert_int_equal(el_message_decode(&f, &m), EL_ERR_TYPE);
    memset(&m, 0, sizeof m);
    m.type = 0x7F;
    assert_int_equal(el_payload_encode(&m, payload, sizeof payload, &n), EL_ERR_TYPE);
    assert_int_equal(el_frame_encode(EL_MSG_LOG, 0, payload, EL_MAX_PAYLOAD + 1, payload, sizeof payload, &n),
                     EL_ERR_LENGTH);
}

/* Every vector the Python implementation wrote: same bytes, same fields, same decoder results. */
static void test_python_vectors(void **state)
{
    char line[8192], name[128], kind[32], hex[4096], want[4096], got[4096], errname[32];
    uint8_t bytes[2048], reenc[EL_MAX_ENCODED];
    FILE *file = fopen(vectors_path, "r");
    int messages = 0, streams = 0, rejects = 0;
    (void)state;
    assert_non_null(file);
    while (fgets(line, sizeof line, file) != NULL) {
        el_decoder d;
        el_frame f;
        el_message m;
        long n;
        size_t i, k = 0;
        el_rx_result r;
        if (json_string(line, "kind", kind, sizeof kind) != 0) {
            continue;
        }
        assert_int_equal(json_string(line, "name", name, sizeof name), 0);
        el_decoder_init(&d);
        got[0] = '\0';
        if (strcmp(kind, "stream") == 0) {
            assert_int_equal(json_string(line, "stream", hex, sizeof hex), 0);
            assert_int_equal(json_string(line, "results", want, sizeof want), 0);
            n = unhex(hex, bytes, sizeof bytes);
            assert_true(n >= 0);
            for (i = 0; i < (size_t)n; i++) {
                r = el_decoder_push(&d, bytes[i], &f);
                if (r != EL_RX_PENDING) {
                    if (got[0] != '\0') {
                        strcat(got, ",");
                    }
                    strcat(got, el_rx_result_name(r));
                }
            }
            if (strcmp(got, want) != 0) {
                fail_msg("vector %s: decoder gave %s, Python %s", name, got, want);
            }
            streams++;
            continue;
        }
        assert_int_equal(json_string(line, "frame", hex, sizeof hex), 0);
        n = unhex(hex, bytes, sizeof bytes);
        assert_true(n > 0);
        for (i = 0; i < (size_t)n; i++) {
            r = el_decoder_push(&d, bytes[i], &f);
            if (r != EL_RX_PENDING) {
                if (r != EL_RX_FRAME) {
                    fail_msg("vector %s: frame dropped as %s", name, el_rx_result_name(r));
                }
                k++;
            }
        }
        assert_int_equal(k, 1);
        if (strcmp(kind, "reject") == 0) {
            el_status st = el_message_decode(&f, &m);
            assert_int_equal(json_string(line, "error", errname, sizeof errname), 0);
            if (!((st == EL_ERR_LENGTH && strcmp(errname, "length") == 0) ||
                  (st == EL_ERR_TYPE && strcmp(errname, "type") == 0))) {
                fail_msg("vector %s: C says status %d, Python %s", name, st, errname);
            }
            rejects++;
            continue;
        }
        assert_int_equal(el_message_decode(&f, &m), EL_OK);
        assert_int_equal(json_string(line, "describe", want, sizeof want), 0);
        assert_int_equal(el_describe(&m, got, sizeof got), 0);
        if (strcmp(got, want) != 0) {
            fail_msg("vector %s: C reads %s\nPython wrote %s", name, got, want);
        }
        assert_int_equal(el_message_encode(&m, reenc, sizeof reenc, &i), EL_OK);
        assert_int_equal(i, (size_t)n);
        assert_memory_equal(reenc, bytes, i);
        messages++;
    }
    fclose(file);
    assert_true(messages >= 9);
    assert_true(streams >= 3);
    assert_true(rejects >= 2);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c_check_value),
        cmocka_unit_test(test_cobs_known_values),
        cmocka_unit_test(test_cobs_round_trip_property),
        cmocka_unit_test(test_every_message_round_trips),
        cmocka_unit_test(test_decoder_survives_garbage_truncation_and_resyncs),
        cmocka_unit_test(test_streaming_equals_one_shot),
        cmocka_unit_test(test_length_and_type_errors),
        cmocka_unit_test(test_python_vectors),
    };
    if (argc > 1) {
        vectors_path = argv[1];
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
