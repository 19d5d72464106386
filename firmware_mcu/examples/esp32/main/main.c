/*
 * ESP32 MCU node for edgerun: edgelink on UART1 at 921600 baud, two model slots in the "models"
 * partition, signed updates relayed by the edgerun node. Where the TinyML model runs
 * (run_model_once) is the application's: this example reports what it would send.
 * Built with ESP-IDF >= 5.0 (idf.py build); not built in CI.
 */
#include <string.h>

#include "driver/uart.h"
#include "esp_log.h"
#include "esp_timer.h"
#include "freertos/FreeRTOS.h"
#include "freertos/task.h"

#include "edgelink.h"
#include "modelslot.h"
#include "partition_storage.h"
#include "release_key.h"

#define LINK_UART UART_NUM_1
#define LINK_BAUD 921600
#define LINK_TX_PIN 17
#define LINK_RX_PIN 18
#define SLOT_SIZE (256u * 1024u)
#define FW_VERSION 0x00010000u

static const char *TAG = "edgelink";
static modelslot slots;
static ms_storage storage;
static uint16_t tx_seq;
static el_heartbeat health;

static uint32_t now_ms(void)
{
    return (uint32_t)(esp_timer_get_time() / 1000);
}

static void send(el_message *m)
{
    uint8_t out[EL_MAX_ENCODED];
    size_t n = 0;
    m->seq = tx_seq;
    if (el_message_encode(m, out, sizeof out, &n) == EL_OK) {
        tx_seq++;
        uart_write_bytes(LINK_UART, out, n);
    }
}

static void send_hello(void)
{
    el_message m;
    ms_slot_info info;
    uint8_t slot = MS_NO_SLOT;
    memset(&m, 0, sizeof m);
    m.type = EL_MSG_HELLO;
    m.u.hello.device_id = 1;
    m.u.hello.fw_version = FW_VERSION;
    m.u.hello.frame_width = 96;
    m.u.hello.frame_height = 96;
    if (ms_active(&slots, &slot, &info) == MS_OK) {
        m.u.hello.model_version = info.version;
        memcpy(m.u.hello.model_name, info.name, EL_MODEL_NAME_LEN);
    }
    m.u.hello.active_slot = slot;
    send(&m);
}

static uint8_t nack_reason(ms_status st)
{
    switch (st) {
    case MS_ERR_UNKNOWN_KEY: return EL_NACK_UNKNOWN_KEY;
    case MS_ERR_BAD_SIGNATURE: return EL_NACK_BAD_SIGNATURE;
    case MS_ERR_BAD_MANIFEST: return EL_NACK_BAD_MANIFEST;
    case MS_ERR_ROLLBACK: return EL_NACK_ROLLBACK;
    case MS_ERR_TOO_LARGE: return EL_NACK_TOO_LARGE;
    case MS_ERR_NO_SESSION: return EL_NACK_NO_SESSION;
    case MS_ERR_BAD_OFFSET: return EL_NACK_BAD_OFFSET;
    case MS_ERR_INCOMPLETE: return EL_NACK_INCOMPLETE;
    case MS_ERR_HASH_MISMATCH: return EL_NACK_HASH_MISMATCH;
    default: return EL_NACK_STORAGE;
    }
}

static void reply(const el_message *to, ms_status st, uint32_t value)
{
    el_message m;
    memset(&m, 0, sizeof m);
    m.type = st == MS_OK ? EL_MSG_ACK : EL_MSG_NACK;
    m.u.ack.acked_type = to->type;
    m.u.ack.acked_seq = to->seq;
    m.u.ack.reason = st == MS_OK ? 0 : nack_reason(st);
    m.u.ack.value = value;
    send(&m);
}

static void handle(const el_frame *f)
{
    el_message m;
    uint32_t offset = 0;
    ms_status st;
    ms_slot_info info;
    uint8_t slot;
    if (el_message_decode(f, &m) != EL_OK) {
        health.rx_bad_frames++;
        return;
    }
    switch (m.type) {
    case EL_MSG_HELLO:
        send_hello();
        break;
    case EL_MSG_OTA_BEGIN:
        st = ms_begin(&slots, m.u.ota_begin.manifest, m.u.ota_begin.key_id, m.u.ota_begin.signature, &offset);
        reply(&m, st, offset);
        break;
    case EL_MSG_OTA_CHUNK:
        st = ms_write(&slots, m.u.ota_chunk.offset, m.u.ota_chunk.data, m.u.ota_chunk.len);
        reply(&m, st, slots.received);
        break;
    case EL_MSG_OTA_END:
        st = ms_finish(&slots);
        if (st == MS_OK) {
            /* Load the new model into the interpreter here; commit only if that works. */
            st = ms_verify_slot(&slots, slots.meta.active);
            st = st == MS_OK ? ms_commit(&slots) : ms_rollback(&slots);
        }
        reply(&m, st, ms_active(&slots, &slot, &info) == MS_OK ? info.version : 0);
        send_hello();
        break;
    default:
        break;
    }
}

/* The application's TinyML inference; returns 1 and fills *d when it found something. */
static int run_model_once(el_detection *d)
{
    (void)d;
    return 0;
}

void app_main(void)
{
    const esp_partition_t *partition = NULL;
    const uart_config_t uart = {
        .baud_rate = LINK_BAUD,
        .data_bits = UART_DATA_8_BITS,
        .parity = UART_PARITY_DISABLE,
        .stop_bits = UART_STOP_BITS_1,
        .flow_ctrl = UART_HW_FLOWCTRL_DISABLE,
        .source_clk = UART_SCLK_DEFAULT,
    };
    static el_decoder dec;
    el_frame frame;
    el_message m;
    uint8_t buf[128];
    uint32_t last_hb = 0;
    int n, i;

    ESP_ERROR_CHECK(uart_driver_install(LINK_UART, 2048, 4096, 0, NULL, 0));
    ESP_ERROR_CHECK(uart_param_config(LINK_UART, &uart));
    ESP_ERROR_CHECK(uart_set_pin(LINK_UART, LINK_TX_PIN, LINK_RX_PIN, UART_PIN_NO_CHANGE, UART_PIN_NO_CHANGE));
    ESP_ERROR_CHECK(partition_storage_bind("models", &storage, &partition));
    if (ms_init(&slots, &storage, SLOT_SIZE, RELEASE_KEYS, sizeof RELEASE_KEYS / sizeof RELEASE_KEYS[0]) != MS_OK) {
        ESP_LOGE(TAG, "model slots unreadable");
        return;
    }
    if (slots.meta.trial) {
        ESP_LOGW(TAG, "reset during a model trial: rolling back");
        (void)ms_rollback(&slots);
    }
    el_decoder_init(&dec);
    send_hello();
    for (;;) {
        n = uart_read_bytes(LINK_UART, buf, sizeof buf, pdMS_TO_TICKS(5));
        for (i = 0; i < n; i++) {
            el_rx_result r = el_decoder_push(&dec, buf[i], &frame);
            if (r == EL_RX_FRAME) {
                handle(&frame);
            } else if (r != EL_RX_PENDING) {
                health.rx_bad_frames++;
            }
        }
        memset(&m, 0, sizeof m);
        if (run_model_once(&m.u.detection)) {
            m.type = EL_MSG_DETECTION;
            m.u.detection.timestamp_ms = now_ms();
            send(&m);
            health.detections_sent++;
        }
        if (now_ms() - last_hb >= 1000) {
            last_hb = now_ms();
            memset(&m, 0, sizeof m);
            m.type = EL_MSG_HEARTBEAT;
            m.u.heartbeat = health;
            m.u.heartbeat.uptime_ms = last_hb;
            send(&m);
        }
    }
}
